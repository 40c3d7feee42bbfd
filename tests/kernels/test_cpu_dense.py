"""The decode step's dense projections (kernels/cpu_dense.py, csrc/dense_cpu.cpp) and its thread
pool: `linear` against F.linear on odd shapes (every row and token remainder path), bfloat16
weights widened exactly, bias, strided inputs, results independent of the thread count, of the
rows a row is read beside and (from 4 tokens on) of the other tokens of the batch, the pool's
workers really taking items, the fallbacks (many rows, other dtypes, the switch), and the
read-in-runs bandwidth probe."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moebench.kernels import cpu_dense
from moebench.kernels.cpu_moe import load_extension


@pytest.fixture(scope="module")
def ext():
    module = load_extension()
    if module is None:
        pytest.skip("the C++ extension is not available here")
    return module


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _close(got, want):
    scale = want.abs().max().item() or 1.0
    assert (got - want).abs().max().item() <= 2e-5 * scale * max(1.0, want.shape[-1] ** 0.5 / 8)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16, 17, 32])
@pytest.mark.parametrize("m,k", [(1, 7), (3, 9), (8, 64), (13, 100), (67, 129), (300, 1024), (64, 1030)])
def test_dense_linear_matches_f_linear(ext, n, m, k):
    g = torch.Generator().manual_seed(n * 1000 + m + k)
    x, w = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    _close(ext.dense_linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("n,k", [(5, 128), (17, 1030)])  # 17 tokens: two slabs of the packed copy
def test_dense_linear_bias_and_strided_rows(ext, n, k):
    g = torch.Generator().manual_seed(n)
    big = torch.randn(n, k + 172, generator=g)
    x = big[:, 10:10 + k]  # rows k + 172 apart, 40 bytes in: not 32-byte aligned
    w = torch.randn(70, k + 72, generator=g)[:, :k]
    bias = torch.randn(70, generator=g)
    _close(ext.dense_linear(x, w, bias), F.linear(x, w, bias))


@pytest.mark.parametrize("n", [5, 7, 8, 13, 16, 17, 20, 32])
@pytest.mark.parametrize("k", [1024, 1030, 300])
def test_with_4_tokens_or_more_a_token_does_not_depend_on_the_batch(ext, n, k):
    """From 4 tokens on, each (row, token) is one accumulator over K in one order, however the
    tokens are grouped and K is chunked (csrc/dense_cpu.cpp, kChunk): a token projected among n
    others comes out bit for bit as among any 4."""
    g = torch.Generator().manual_seed(n * 100 + k)
    x, w = torch.randn(n, k, generator=g), torch.randn(130, k, generator=g)  # 2 items + 2 rows
    batch = ext.dense_linear(x, w, None)
    for t in range(n):
        others = [(t + j) % n for j in range(1, 4)]
        four = ext.dense_linear(x[[t] + others], w, None)
        assert torch.equal(batch[t], four[0]), t


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_decode_row_does_not_depend_on_the_rows_read_beside_it(ext, n):
    """With 1-3 tokens an item's rows are read as four runs side by side; each row is still summed in
    one fixed order, so it comes out as it does projected alone."""
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(n, 1000, generator=g), torch.randn(203, 1000, generator=g)  # 3 items + 11 rows
    together = ext.dense_linear(x, w, None)
    alone = torch.cat([ext.dense_linear(x, w[r : r + 1], None) for r in range(w.shape[0])], dim=1)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_streamed_items_sized_in_bytes_change_no_sum(ext, threads, n):
    """With 1-3 tokens an item takes the rows of four runs of ~128 KB, fewer where the threads would
    get under two items each (csrc/cpu_common.h: streamed_item_rows): 600 bfloat16 rows are 3 items
    of 256 at one thread and 5 of 128 at two, and every row still comes out as projected alone."""
    g = torch.Generator().manual_seed(10 + n)
    x, w = torch.randn(n, 1024, generator=g), torch.randn(600, 1024, generator=g).to(torch.bfloat16)
    torch.set_num_threads(1)
    one = ext.dense_linear(x, w)
    torch.set_num_threads(2)
    two = ext.dense_linear(x, w)
    alone = torch.cat([ext.dense_linear(x, w[r : r + 1]) for r in range(0, 600, 37)], dim=1)
    default = ext.stream_run_bytes()
    ext.set_stream_run_bytes(0)  # 64 rows an item, whatever the dtype
    try:
        fixed = ext.dense_linear(x, w)
    finally:
        ext.set_stream_run_bytes(default)
    assert default == 128 * 1024
    assert torch.equal(one, two) and torch.equal(one, fixed) and torch.equal(one[:, ::37], alone)
    _close(one, F.linear(x, w.float()))
    with pytest.raises(RuntimeError, match="must be >= 0"):
        ext.set_stream_run_bytes(-1)


@pytest.mark.parametrize("n", [1, 3])
def test_moe_blocks_sized_in_bytes_change_no_sum(ext, threads, n):
    """One bfloat16 expert of the 0.89B shape: its gate/up block is 128 rows at one thread and 64 at
    two, its down block 512 and 256 (csrc/moe_cpu.cpp): the same result bit for bit."""
    g = torch.Generator().manual_seed(20 + n)
    e, h, i = 4, 1024, 256
    x = torch.randn(n, h, generator=g)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / 16).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) / 16).to(torch.bfloat16)
    ids, wts = torch.full((n, 1), 2, dtype=torch.int64), torch.rand(n, 1, generator=g)
    torch.set_num_threads(1)
    one = ext.fused_moe(x, wts, ids, w13, w2)
    torch.set_num_threads(2)
    two = ext.fused_moe(x, wts, ids, w13, w2)
    assert torch.equal(one, two)
    from moebench.kernels.reference import moe_reference

    _close(one, moe_reference(x, wts, ids, w13.float(), w2.float()))


def test_read_in_runs_reads_every_value(ext, threads):
    for t in (1, 2):
        torch.set_num_threads(t)
        x = torch.ones(3 * 2**18 + 5)  # 3 items of four runs, and a remainder
        assert ext.read_in_runs(x) == x.numel()
        x = torch.arange(2**19, dtype=torch.float32) % 7
        assert ext.read_in_runs(x) == float(x.double().sum())


def test_bfloat16_weights_widen_exactly(ext):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 257, generator=g)
    w = torch.randn(131, 257, generator=g).to(torch.bfloat16)
    assert torch.equal(ext.dense_linear(x, w), ext.dense_linear(x, w.float()))


def test_result_does_not_depend_on_threads(ext, threads):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(16, 1024, generator=g), torch.randn(4099, 1024, generator=g)
    torch.set_num_threads(1)
    one = ext.dense_linear(x, w)
    torch.set_num_threads(2)
    two = ext.dense_linear(x, w)
    assert torch.equal(one, two)


def test_pool_workers_take_items(ext, threads):
    """With two threads the pool's worker runs items of a large projection (not only the caller).
    A worker that wakes late finds nothing left, so this needs many sections to be sure of one."""
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(16, 1024, generator=g), torch.randn(8192, 1024, generator=g)
    before = cpu_dense.pool_stats()
    for _ in range(40):
        ext.dense_linear(x, w)
    after = cpu_dense.pool_stats()
    assert after["workers"] >= 1
    assert after["sections"] >= before["sections"] + 40
    assert after["worker_items"] > before["worker_items"]


def test_pool_counts_the_callers_waits_at_section_ends(ext, threads):
    """A section whose calling thread finishes its items while a worker still runs one is counted, with
    the time it waited; with one thread nothing is handed out and nothing waited for."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(1, 1024, generator=g), torch.randn(8192, 1024, generator=g)
    torch.set_num_threads(1)
    before = cpu_dense.pool_stats()
    for _ in range(20):
        ext.dense_linear(x, w)
    after = cpu_dense.pool_stats()
    assert after["caller_waits"] == before["caller_waits"] and after["caller_wait_ns"] == before["caller_wait_ns"]
    torch.set_num_threads(2)
    # which thread ends a section last is a race: run sections until the caller has waited at one
    for _ in range(400):
        ext.dense_linear(x, w)
        now = cpu_dense.pool_stats()
        if now["caller_waits"] > after["caller_waits"]:
            break
    assert now["caller_waits"] > after["caller_waits"], now
    assert now["caller_wait_ns"] > after["caller_wait_ns"]
    assert now["caller_waits"] - after["caller_waits"] <= now["sections"] - after["sections"]


def test_fused_moe_on_the_pool_matches_one_thread(ext, threads):
    """The MoE kernel's three phases run on the pool: the result is bit-identical for 1 and 2 threads
    on a layer large enough to be split (the small-layer shortcut runs one thread)."""
    g = torch.Generator().manual_seed(5)
    e, h, i, n, k = 32, 256, 128, 16, 4
    x = torch.randn(n, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) / 16, torch.randn(e, h, i, generator=g) / 16
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    wts = torch.rand(n, k, generator=g)
    torch.set_num_threads(1)
    one = ext.fused_moe(x, wts, ids, w13, w2)
    torch.set_num_threads(2)
    two = ext.fused_moe(x, wts, ids, w13, w2)
    assert torch.equal(one, two)
    from moebench.kernels.reference import moe_reference

    _close(two, moe_reference(x, wts, ids, w13, w2))


def test_linear_uses_the_kernel_for_decode_rows_only(ext, monkeypatch):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(40, 24, generator=g)
    before = cpu_dense.dense_backends()
    decode = cpu_dense.linear(torch.randn(3, 24, generator=g), w)
    prefill = cpu_dense.linear(torch.randn(cpu_dense.DENSE_MAX_ROWS + 1, 24, generator=g), w)
    double = cpu_dense.linear(torch.randn(3, 24, generator=g, dtype=torch.float64), w.double())
    after = cpu_dense.dense_backends()
    assert after.get(cpu_dense.BACKEND_CPP, 0) - before.get(cpu_dense.BACKEND_CPP, 0) == 1
    assert after.get(cpu_dense.BACKEND_TORCH, 0) - before.get(cpu_dense.BACKEND_TORCH, 0) == 2
    assert decode.shape == (3, 40) and prefill.shape == (33, 40) and double.dtype == torch.float64
    x = torch.randn(3, 24, generator=g)  # the dense override's op (engine/overrides.py): torch for any rows
    assert torch.equal(cpu_dense.torch_linear(x, w), F.linear(x, w))


def test_bad_shapes_are_refused(ext):
    with pytest.raises(RuntimeError, match="dense_linear"):
        ext.dense_linear(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="dense_linear"):
        ext.dense_linear(torch.randn(2, 8), torch.randn(4, 8), torch.randn(5))


def test_back_to_back_sections_run_each_item_once_and_end_after_them(ext):
    """A worker that read the last claim of a section while the caller already published the next
    section's larger item count used to claim a stale item, so that the next section ended with an
    item still running (a crash in a decode step at batch 4, one run in three). 200k sections of
    changing sizes catch it in a tenth of a second."""
    assert ext.pool_selftest(200_000, 2) == 0


def test_step_threads_hand_torch_threads_to_the_pool_and_count_what_ran(ext, threads):
    torch.set_num_threads(2)
    step = ext.StepThreads(True)
    for _ in range(2):
        with step:
            assert torch.get_num_threads() == 1
            assert ext.pool_threads() == 2
    assert torch.get_num_threads() == 2 and ext.pool_threads() == 2  # the pool follows torch again
    assert step.seen() == {"pool=2 torch=1": 2}
    torch.set_num_threads(1)
    assert ext.pool_threads() == 1
    with step:  # one thread: nothing to hand over
        assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    with pytest.raises(ValueError):
        with step:  # an exception in the step: torch has its threads back all the same
            raise ValueError
    assert torch.get_num_threads() == 2 and ext.pool_threads() == 2
    eager = ext.StepThreads(False)
    with eager:  # no pool: torch keeps its threads
        assert torch.get_num_threads() == 2
    assert step.seen() == {"pool=2 torch=1": 3, "pool=1 torch=1": 1} and eager.seen() == {"pool=2 torch=2": 1}


def test_engine_decode_runs_on_the_pool_and_restores_threads(ext, threads, tmp_path):
    """A decode step of the runtime at 2 threads: torch has its 2 threads back after each step, and
    greedy outputs equal the 1-thread run (the kernels' results do not depend on the thread count)."""
    from moebench.engine import Engine, Request, RuntimeConfig, load_checkpoint
    from tiny_models import make_tiny_checkpoint

    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path / "m"))
    prompts = [[3, 5, 7, 11], [2, 4, 6, 8, 10]]
    outputs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        engine = Engine(ckpt, None, RuntimeConfig(kernel="fused", batch_size=2, max_new_tokens=6))
        result = engine.generate([Request(f"r{i}", "", 6) for i in range(2)], prompt_ids=prompts)
        assert torch.get_num_threads() == n
        outputs.append([c.output_ids for c in result.completions])
    assert outputs[0] == outputs[1]
