"""On PYTHONPATH, this makes the installed DeepSpeed invisible: a machine without it, for test_hf_integration.py.

`import deepspeed` (and importlib.util.find_spec) finds nothing in site-packages; only a `deepspeed` that lives in
ds_compat/shim (put before this directory by ds-fsdp) is still found. The distribution metadata of the real package
stays readable, but the shim's comes first on sys.path, as it would on a machine without DeepSpeed.
"""

import importlib.abc
import importlib.machinery
import sys


class HideInstalledDeepSpeed(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and "ds_compat" not in str(spec.origin):
            raise ModuleNotFoundError(f"No module named '{fullname}' (hidden by tests/hide_deepspeed)", name=fullname)
        return None


sys.meta_path.insert(0, HideInstalledDeepSpeed())
