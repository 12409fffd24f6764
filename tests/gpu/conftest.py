import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: run tests/gpu on a GPU machine")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def drafter_path(tmp_path_factory):
    """A random-weight EAGLE-3 drafter for the default model, saved: losslessness and graph
    tests do not depend on its quality."""
    from outrider.env import default_model
    from outrider.loaders.checkpoint import open_checkpoint
    from outrider.models.eagle3_io import save_drafter
    from tests.unit.test_spec_eagle3 import random_drafter

    target = open_checkpoint(default_model()).config  # OUTRIDER_MODEL, as the engines take
    path = tmp_path_factory.mktemp("eagle3") / "drafter"
    save_drafter(random_drafter(target, draft_vocab=8000), path)
    return str(path)


@pytest.fixture(autouse=True)
def _release_cuda_memory():
    """Before and after every GPU test: collect the engines earlier tests made (their graphs
    and buffers hold references in cycles) and hand their cached memory back, so this test's
    engine sizes its KV pool on a free device whatever ran before it. Before as well as after:
    a module-scoped fixture's engine (a test server's) is torn down after its module's last
    test has had its own teardown, and the next module's first engine found that memory still
    held (its KV budget held 0 blocks when the GPU files ran in one process on an H100)."""
    _release()
    yield
    _release()


def _release() -> None:
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
