import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny shapes gain nothing from threads, and on a busy 2-core machine OpenMP barriers stall."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
