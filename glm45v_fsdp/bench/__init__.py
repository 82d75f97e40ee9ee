"""The benchmarks behind `python -m glm45v_fsdp.tools.bench` and `python -m glm45v_fsdp.tools.plan --validate`:
runner.py starts, times and reads the training runs and writes the reports, charts.py draws them, and each other
module is one scenario: which runs it makes and which rows, tables and charts it derives from them."""
