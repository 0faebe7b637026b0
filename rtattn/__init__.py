"""rtattn: framework-free attention engine for LLM serving (cuda-python driver API).

    import rtattn
    w = rtattn.BatchDecodeWrapper(32, 8, 128, 16, max_batch=256, max_pages=65536)
    w.plan(kv_indptr, kv_indices, kv_last_page_len)   # host arrays, once per step
    out = w.run(q, k_cache, v_cache)                   # DLPack tensors, once per layer
    p = rtattn.BatchPrefillWrapper(32, 8, 128, 16, max_batch=16, max_qo_tokens=16384, max_pages=8192)
    p.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len); out = p.run(q, k_cache, v_cache)

Importing rtattn never needs a GPU; asking for a device without one raises NoDeviceError.
"""
import importlib.abc
import importlib.util
import sys
from pathlib import Path

# pyproject.toml's package-dir: subpackages installed into rtattn/ from top-level folders.
MAPPED_SUBPACKAGES = {"rtattn.codegen": "codegen", "rtattn.graphs": "graphs", "rtattn.cuda_src": "cuda_src"}


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Imported from a source checkout (its root first on sys.path, as in `python -c 'import
    rtattn'` there, even with rtattn installed non-editable), rtattn/ lacks the mapped
    subpackages: find them in their top-level folders, as the installed package has them."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        folder = MAPPED_SUBPACKAGES.get(fullname)
        if folder is None:
            return None
        init = self.root / folder / "__init__.py"
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


def _find_mapped_subpackages_in_the_source_tree() -> None:
    here = Path(__file__).resolve().parent
    if (here / "codegen").is_dir() or not (here.parent / "codegen" / "__init__.py").is_file():
        return   # installed (setuptools put them inside), or not a checkout
    if not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
        sys.meta_path.append(_SourceTreeFinder(here.parent))


_find_mapped_subpackages_in_the_source_tree()

from rtattn.codegen.spec import AttentionSpec, Param, custom_variant  # noqa: E402
from rtattn.cascade import CascadeWrapper  # noqa: E402
from rtattn.merge import merge_state, merge_states  # noqa: E402
from rtattn.runtime import NoDeviceError, has_device  # noqa: E402
from rtattn.prefill_wrapper import BatchPrefillWrapper  # noqa: E402
from rtattn.wrapper import BatchDecodeWrapper  # noqa: E402
from rtattn.family_wrapper import multi_token_wrapper  # noqa: E402
from rtattn.shared_plan import SharedPlan  # noqa: E402

__all__ = ["BatchDecodeWrapper", "BatchPrefillWrapper", "CascadeWrapper", "SharedPlan", "multi_token_wrapper", "AttentionSpec", "Param", "custom_variant", "merge_state", "merge_states",
           "NoDeviceError", "has_device"]
