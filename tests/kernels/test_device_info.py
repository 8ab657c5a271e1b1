import torch

from pagedllm.kernels import device_info


def test_is_sm90_asks_cuda_once_per_device(monkeypatch):
    asked = []
    caps = {0: (9, 0), 1: (10, 0), 2: (8, 9)}

    def capability(index):
        asked.append(index)
        return caps[index]

    monkeypatch.setattr(device_info, "_SM90", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    assert [device_info.is_sm90(i) for i in (0, 1, 2, 0, 1, 2)] == [True, False, False] * 2
    assert asked == [0, 1, 2]


def test_device_index_of_an_index_less_device(monkeypatch):
    class _T:  # a stand-in: the CPU machine has no CUDA tensors
        def __init__(self, device):
            self.device = torch.device(device)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert device_info.device_index(_T("cuda")) == 3
    assert device_info.device_index(_T("cuda:1")) == 1
