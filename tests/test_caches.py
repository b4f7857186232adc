"""seqckpt._caches: a key/value cache given to a region is filled once, and
its recompute sees the cache its forward saw."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import seqckpt
from tests.oracle import assert_matches_plain


class KVCacheLayer:
    """One layer's part of the cache, as HF's ``DynamicLayer``: its keys are
    replaced by a longer tensor at each update, never written in place."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None

    def update(self, keys: torch.Tensor) -> torch.Tensor:
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys], 1)
        return self.keys


class KVCache:
    """HF's ``DynamicCache`` in small: one part per layer, made on first use."""

    def __init__(self, prefix: torch.Tensor | None = None, layers: int = 0) -> None:
        self.layers: list[KVCacheLayer] = []
        self.seen: dict[int, int] = {}
        for i in range(layers if prefix is not None else 0):
            self.update(prefix, i)

    def update(self, keys: torch.Tensor, index: int) -> torch.Tensor:
        while len(self.layers) <= index:
            self.layers.append(KVCacheLayer())
        self.seen[index] = self.seen.get(index, 0) + 1
        return self.layers[index].update(keys)


class Attention(nn.Module):
    """Attends over every key the cache holds for it once updated: a second
    update by a recompute would change its shapes and values."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.key = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        keys = self.key(x)
        if cache is not None:
            keys = cache.update(keys, self.index)
        weights = torch.softmax(x @ keys.transpose(1, 2), -1)
        return x + self.out(self.drop(weights @ keys))


class Decoder(nn.Module):
    """A decoder that makes its cache in forward (as HF's do with
    ``use_cache=True``), optionally prefilled with learned keys (prefix
    tuning), and returns the cache's keys beside its output."""

    def __init__(self, route: str = "plain", prefix: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Attention(i) for i in range(3))
        self.prefix = nn.Parameter(torch.randn(2, 3, 8)) if prefix else None
        self.route = route

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cache = KVCache(self.prefix, len(self.layers))
        for layer in self.layers:
            if self.route == "checkpoint":
                x = seqckpt.checkpoint(layer, x, cache=cache)
            elif self.route == "partial":  # how HF's layers call it
                x = seqckpt.checkpoint(functools.partial(layer, cache=cache), x)
            else:
                x = layer(x, cache=cache)
        assert all(n == 1 + (self.prefix is not None) for n in cache.seen.values())
        return (x, *(part.keys for part in cache.layers))


@pytest.mark.parametrize("prefix", [False, True], ids=["fresh", "prefilled"])
@pytest.mark.parametrize("route", ["blocks", "checkpoint", "partial"])
def test_a_cache_is_filled_once_and_the_recompute_sees_it_as_it_was(
    route: str, prefix: bool
) -> None:
    x = torch.randn(2, 5, 8, requires_grad=True)

    def checkpointed(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if route == "blocks":
            seqckpt.checkpoint_blocks(model)
        else:
            model.route = route
        return model(x)

    # outputs, the cache's keys (the decoder asserts one update per layer),
    # gradients (the prefix's too) and RNG: bitwise those of the plain run
    assert_matches_plain(Decoder(prefix=prefix), x, checkpointed)


def test_the_recompute_runs_on_a_copy_each_time() -> None:
    layer = Attention(0)
    cache = KVCache()
    x = torch.randn(2, 5, 8, requires_grad=True)
    y = seqckpt.checkpoint(layer, x, cache=cache)
    for _ in range(2):  # a second backward recomputes again
        (grad,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
    assert cache.seen == {0: 1} and cache.layers[0].keys is not None
    assert cache.layers[0].keys.shape == (2, 5, 8)


class StateCache:
    """A recurrent state written in place, as HF's linear-attention caches
    write theirs and count their tokens (a 0-d tensor they add to)."""

    def __init__(self, rows: int) -> None:
        self.state = torch.zeros(rows, 8)
        self.length = torch.zeros((), dtype=torch.long)


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: StateCache) -> torch.Tensor:
        cache.length.add_(1)
        y = torch.tanh(self.lin(x) + cache.length + cache.state)
        cache.state.copy_(y.detach())
        return y


def test_counters_and_small_states_written_in_place_are_copied_by_value() -> None:
    def run(model: nn.Module, x: torch.Tensor, checkpointed: bool) -> torch.Tensor:
        cache = StateCache(rows=x.shape[0])
        for _ in range(2):
            x = (
                seqckpt.checkpoint(model, x, cache=cache)
                if checkpointed
                else model(x, cache)
            )
        assert int(cache.length) == 2
        return torch.cat([x, cache.state])

    x = torch.randn(2, 8, requires_grad=True)
    assert_matches_plain(
        Recurrent(), x, lambda m, x: run(m, x, True), lambda m, x: run(m, x, False)
    )


def test_a_larger_cache_tensor_written_in_place_is_refused_at_backward() -> None:
    layer, cache = Recurrent(), StateCache(rows=16)  # 128 elements: shared
    y = seqckpt.checkpoint(layer, torch.randn(16, 8, requires_grad=True), cache=cache)
    with pytest.raises(
        seqckpt.CheckpointError, match="written in place.*use_cache=False"
    ):
        y.sum().backward()
