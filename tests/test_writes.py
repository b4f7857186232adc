"""seqckpt._writes: which tensors an aten op writes into."""

from __future__ import annotations

import torch

from seqckpt._writes import written_by

aten = torch.ops.aten


def test_undeclared_writes_of_running_statistics_are_seen() -> None:
    x, mean, var = torch.randn(4, 3, 5), torch.zeros(3), torch.ones(3)
    weight, bias = torch.ones(3), torch.zeros(3)
    update = (x, mean, var, 0.1)
    assert written_by(aten.batch_norm_update_stats.default, update, {}) == [mean, var]
    norm = (x, weight, bias, mean, var)
    train, test = (*norm, True, 0.1, 1e-5), (*norm, False, 0.1, 1e-5)
    assert written_by(aten.native_batch_norm.default, train, {}) == [mean, var]
    assert written_by(aten.native_batch_norm.default, test, {}) == []
    assert written_by(aten.add_.Tensor, (x, x), {}) == [x]  # declared: from the schema
