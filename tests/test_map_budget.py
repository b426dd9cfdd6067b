"""Warm-up refuses, with a clear error, a configuration whose executables would pass vm.max_map_count
(XLA:CPU would otherwise fail to allocate in a later compile, mid-warm-up or while serving)."""
import pytest

from atlas_jax.engine import runner
from atlas_jax.host_memory import memory_maps


def test_memory_maps_reads_this_process():
    held, limit = memory_maps()
    assert 0 < held < limit


def _fake_maps(monkeypatch, held: int, limit: int = 65530):
    monkeypatch.setattr(runner, "memory_maps", lambda: (held, limit))


def test_budget_extrapolates_the_executables_compiled_so_far(monkeypatch):
    before = (1000, 65530)
    _fake_maps(monkeypatch, 1000 + 10 * 400)          # 10 executables of ~400 mappings each
    runner._check_map_budget(before, 10, 100)           # ~41000 projected: fits
    with pytest.raises(runner.MapBudgetError, match="vm.max_map_count"):
        runner._check_map_budget(before, 10, 200)       # ~81000 projected
    runner._check_map_budget(before, 3, 10_000)         # too few executables to extrapolate from
    runner._check_map_budget(None, 10, 10_000)          # no /proc: nothing to check


def test_budget_counts_mappings_held_before_warmup(monkeypatch):
    _fake_maps(monkeypatch, 60000 + 10 * 100)           # other engines hold most of the budget
    with pytest.raises(runner.MapBudgetError):
        runner._check_map_budget((60000, 65530), 10, 40)
