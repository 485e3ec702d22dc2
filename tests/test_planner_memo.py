"""The planner's memos (issue 33 item 5: a search asks the same parts of ~10^4 layouts' memory): each
returns what the function it memoises computes, whatever field of the layout changes. A memo keyed on
less than its function reads would hand one layout another's figures; these tests change every
`Layout` field in turn (a field added later must be given a changed value here) after warming the
memo with the unchanged layout."""

from dataclasses import fields, replace

import pytest

from fived.config import Config, ParallelConfig, model_preset
from fived.layout.layout import Layout
from fived.layout.rules import core_layout_errors, layout_errors, per_layout_errors
from fived.layout.stages import model_key, placement, rank_chunks
from fived.planner import memory, validity
from fived.planner.layout_cache import layout_memo
from fived.planner.runtimes import FIVED

BASE = Layout(dp=4, tp=2, pp=2, cp=2, ep=2, zero=1, overlap_grad_reduce=True)
CHANGED = {  # one other value of every field (the base layout's mixtral-8x7b on 32 ranks)
    "dp": 8,
    "tp": 4,
    "pp": 4,
    "cp": 4,
    "ep": 4,
    "zero": 2,
    "dp_replicate": 2,
    "reduce_dtype": "bfloat16",
    "zero3_keep_gathered": True,
    "sp": True,
    "pp_schedule": "zbv",
    "pp_virtual": 2,
    "pp_layers": "20,12",
    "tp_overlap": True,
    "overlap_grad_reduce": False,
    "overlap_param_gather": True,
    "zero2_reduce_every_microbatch": True,
    "bucket_mb": 1.0,
    "ep_overlap": True,
    "etp": 1,
    "cp_mode": "ulysses",
    "cp_ulysses": 2,
    "cp_balance": "halves",
    "micro_batch": 2,
    "checkpointing": "full",
    "optimizer": "muon",
    "muon_bucket_mb": 1.0,
    "muon_ns_steps": 3,
    "document_mask": True,
}


def test_every_layout_field_has_a_changed_value():
    assert set(CHANGED) == {f.name for f in fields(Layout)}


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_state_bytes_memo_answers_what_it_computes_for_every_field_changed(zero):
    model = model_preset("mixtral-8x7b")
    base = BASE.with_(zero=zero)
    for name, value in CHANGED.items():
        for layout in (base, base.with_(**{name: value})):  # (the base first: the memo is warm)
            for pp_rank in range(layout.pp):
                chunks = rank_chunks(model, layout, pp_rank)
                for shard in (0, 1):
                    got = memory.state_bytes(model, layout, "bfloat16", chunks, shard, shard, FIVED)
                    want = memory._state_bytes(model, layout, "bfloat16", chunks, shard, shard, FIVED)
                    assert got == want, (zero, name)


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_state_layout_drops_only_what_the_state_and_its_buffers_do_not_read(zero):
    """Layouts sharing a `state_layout` have the same per-rank state and buffers, computed uncached
    (`__wrapped__`) on each: the cp modes, the tp and ep overlaps, the activation choices."""
    model = model_preset("mixtral-8x7b")
    key = model_key(model)
    base = BASE.with_(zero=zero, cp=4)
    shared = {"cp_mode": "hybrid", "tp_overlap": True, "ep_overlap": True, "sp": True, "micro_batch": 2}
    for name, value in [*shared.items(), ("cp_mode", "ulysses")]:
        layout = base.with_(**{name: value}, **({"cp_ulysses": 2} if value == "hybrid" else {}))
        assert memory.state_layout(layout) == memory.state_layout(base)
        ranks = memory._rank_states.__wrapped__(key, layout, "bfloat16", FIVED)
        assert ranks == memory._rank_states.__wrapped__(key, base, "bfloat16", FIVED), name


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_memory_per_gpu_memos_key_on_every_field_they_read(zero):
    """`memory_per_gpu`'s memos keyed on a layout's values in short (its state's: `_state_ranks`; its
    activations': `_layout_activations`, `_layout_recompute`; an option's: `_option_parts`, at two global
    batches) answer what their functions compute on the
    state and activation layouts, uncached, for every field changed in turn after the base warmed them."""
    model, seq_len = model_preset("mixtral-8x7b"), 4096
    key = model_key(model)
    base = BASE.with_(zero=zero, checkpointing="selective")
    for name, value in CHANGED.items():
        for layout in (base, base.with_(**{name: value})):
            state = memory.state_layout(layout)
            want = (
                memory._rank_sums.__wrapped__(key, state, "bfloat16", FIVED),
                memory._rank_states.__wrapped__(key, state, "bfloat16", FIVED),
            )
            assert memory._state_ranks(key, layout, "bfloat16", FIVED) == want, name
            acts = memory._activation_layout(layout)
            stages = (layout.pp, placement(layout.pp_schedule), layout.n_stages, layout.pp_layers)
            want_acts = memory._rank_activations.__wrapped__(key, acts, *stages, seq_len, "bfloat16", FIVED)
            assert memory._layout_activations(key, layout, seq_len, "bfloat16", FIVED) == want_acts, name
            want_block = memory._recompute_block.__wrapped__(key, acts, seq_len, "bfloat16", FIVED)
            assert memory._layout_recompute(key, layout, seq_len, "bfloat16", FIVED) == want_block, name
            for global_batch in (64, 128):
                args = (key, layout, seq_len, "bfloat16", FIVED, global_batch)
                assert memory._option_parts(*args) == memory._option_parts.__wrapped__(*args), name


def test_layout_memo_keys_on_the_values_and_keeps_the_latest():
    calls = []

    @layout_memo(maxsize=2)
    def tp_of(key, layout, extra):
        calls.append((layout.tp, extra))
        return layout.tp * extra

    a, b = Layout(tp=2), Layout(tp=4)
    assert tp_of(0, a, 3) == tp_of(0, Layout(tp=2), 3) == 6 and calls == [(2, 3)]  # (an equal layout: a hit)
    assert tp_of(0, b, 3) == 12 and tp_of(0, a, 1) == 2 and len(calls) == 3
    assert tp_of(0, a, 3) == 6 and len(calls) == 4  # (the oldest entry was dropped)


def test_a_kept_hash_is_its_values_and_never_pickled():
    """Runtimes, clusters and constants keep their hash (`layout_cache.kept_hash`): equal objects hash
    alike, another value otherwise; a pickled copy carries none (string hashes differ between
    processes) and hashes again."""
    import pickle

    from fived.planner.constants import Constants
    from fived.planner.hardware import Cluster, hardware

    cluster = Cluster(hardware("h100"), 16, 8)
    for obj, other in (
        (FIVED, replace(FIVED, fp8=True)),
        (cluster, Cluster(hardware("h100"), 32, 8)),
        (Constants(), Constants(tp_overlap=0.25)),
    ):
        twin = replace(obj)
        assert hash(twin) == hash(obj) and twin == obj and hash(other) != hash(obj)
        copy = pickle.loads(pickle.dumps(obj))
        assert "_hash" in vars(obj) and "_hash" not in vars(copy)
        assert copy == obj and hash(copy) == hash(obj)


def test_the_first_rule_error_asks_a_cores_rules_once_and_reports_the_rules_first_error():
    """`validity.first_rule_error` (the rules of a layout core memoised) is `layout_errors`' first error,
    uncached, for every field changed in turn after the base warmed the memo; the bases and their changes
    break no rule, only core rules, only per-layout rules (`per_layout_errors`; two of them, whose order
    counts) and both."""
    model = model_preset("mixtral-8x7b")
    seq_len, global_batch = 4096, 64
    split_backward = BASE.with_(pp_schedule="zbv", checkpointing="selective")
    bases = (BASE, BASE.with_(sp=True, etp=1), split_backward, split_backward.with_(tp=1, sp=True))  # (the last: two)
    kinds = set()
    for base in bases:
        for name, value in CHANGED.items():
            for layout in (base, base.with_(**{name: value})):
                mbs = layout.microbatches(global_batch)
                train = validity._train_config(seq_len, global_batch, mbs, layout.checkpointing)
                parallel = ParallelConfig(**{f.name: getattr(layout, f.name) for f in fields(ParallelConfig)})
                cfg = Config(model=model, parallel=parallel, train=train)
                want = layout_errors(cfg, layout.world)
                got = validity.first_rule_error(model, layout, train)
                assert str(got) == str(want[0] if want else None), (name, value, base)
                kinds.add(
                    (
                        bool(core_layout_errors(cfg.model, cfg.parallel, cfg.train, layout.world)),
                        bool(per_layout_errors(parallel, train, layout.dp)),
                    )
                )
    assert kinds == {(False, False), (True, False), (False, True), (True, True)}


def test_the_usable_overlaps_memo_answers_the_rules_for_every_field_changed():
    """`validity.with_usable_overlap` (its choice memoised per core) is the first of `with_overlap`'s
    layout, it without the data-parallel switches, (refused whatever its overlaps: the layout
    itself), without tp's, without both, that the core rules accept, asked uncached, for every field
    changed in turn after the base warmed the memo; on bases that keep every switch, lose tp's (an
    attention bias under tp) and lose the data-parallel ones (multi-token prediction under pp)."""
    from fived.planner.runtimes import with_overlap

    def accepted(model, layout, seq_len, global_batch):
        train = validity._train_config(seq_len, global_batch, layout.microbatches(global_batch), layout.checkpointing)
        parallel = ParallelConfig(**{f.name: getattr(layout, f.name) for f in fields(ParallelConfig)})
        return not core_layout_errors(model, parallel, train, layout.world)

    seq_len, global_batch, kept = 4096, 64, set()
    for name, base in (
        ("mixtral-8x7b", BASE),
        ("gpt-oss-120b", BASE),
        ("deepseek-v3", BASE),
    ):
        model = model_preset(name)
        for field, value in CHANGED.items():
            for layout in (base, base.with_(**{field: value})):
                for fp8 in (False, True):
                    full = with_overlap(layout, fp8=fp8)
                    candidates = [full, full.with_(**validity._DP_OFF)]
                    if accepted(model, layout, seq_len, global_batch):
                        candidates += [
                            full.with_(**validity._TP_OFF),
                            full.with_(**validity._TP_OFF, **validity._DP_OFF),
                        ]
                    want = next((c for c in candidates if accepted(model, c, seq_len, global_batch)), layout)
                    got = validity.with_usable_overlap(model, layout, seq_len, global_batch, fp8=fp8)
                    assert got == want, (name, field, value, fp8)
                    kept.add(
                        (name, got.tp_overlap == full.tp_overlap, got.overlap_grad_reduce == full.overlap_grad_reduce)
                    )
    # (every switch kept; tp's dropped, the data-parallel ones, both; or the layout refused)
    assert kept >= {("mixtral-8x7b", True, True), ("gpt-oss-120b", False, True), ("deepseek-v3", True, False)}
    assert ("gpt-oss-120b", False, False) in kept


def test_the_per_layout_rules_read_only_what_their_memo_keys_on():
    """`validity._per_layout_errors` keys on `batch_rules.PARALLEL_READ`, `TRAIN_READ` and dp: the rules,
    and the messages of those they find broken, read nothing else (every field changed in turn on the
    bases of the test above, whose layouts break every kind of rule)."""
    from fived.layout import batch_rules
    from fived.layout.rules import _Broken

    read: dict[str, set] = {"parallel": set(), "train": set()}

    class Recording:
        def __init__(self, of, kind):
            self._of, self._kind = of, kind

        def __getattr__(self, name):
            read[self._kind].add(name)
            return getattr(self._of, name)

    split_backward = BASE.with_(pp_schedule="zbv", checkpointing="selective", pp=4)
    broken = 0
    for base in (BASE, BASE.with_(sp=True, etp=1), BASE.with_(etp=1), split_backward, BASE.with_(tp=1, sp=True)):
        for name, value in CHANGED.items():
            for global_batch in (64, 6):
                layout = base.with_(**{name: value})
                mbs = max(1, layout.microbatches(global_batch))
                train = validity._train_config(4090, global_batch, mbs, layout.checkpointing)
                need = _Broken(per_layout=True)
                batch_rules.per_layout_rules(need, Recording(layout, "parallel"), Recording(train, "train"), layout.dp)
                broken += len(need.errors)
    assert broken > 100  # (the messages were built)
    assert read["parallel"] == set(batch_rules.PARALLEL_READ)
    assert read["train"] == set(batch_rules.TRAIN_READ)


@pytest.mark.parametrize("zero", [0, 1, 3])
@pytest.mark.parametrize("interleaved", [False, True])  # (pp_virtual changes nothing under 1f1b)
def test_model_parallel_memos_answer_what_the_whole_list_prices_for_every_field_changed(zero, interleaved):
    """The step time's memo of the model-parallel collectives' seconds (`links.model_parallel_seconds`,
    keyed on every field but DATA_PARALLEL_FIELDS and computed with those at their defaults) plus its
    memo of the data-parallel ones' (`links.data_parallel_seconds`, alike without
    MODEL_PARALLEL_FIELDS; Muon's unmemoised) added in order is, bit for bit, the whole
    `step_collectives` list priced in order; explore's memo of rank 0's model-parallel table, merged with the data-parallel rows, is that
    list merged; for every field changed in turn after the base warmed both memos."""
    from collections import defaultdict

    from fived.layout.stages import rank_stages
    from fived.planner import links, timing
    from fived.planner.communication import (
        group_spans,
        model_parallel_runtime,
        step_collectives,
    )
    from fived.planner.constants import CALIBRATION
    from fived.planner.hardware import hardware
    from fived.planner.runtimes import for_layout
    from fived.tools import explore

    model, cluster, c = (
        model_preset("mixtral-8x7b"),
        timing.Cluster(replace(hardware("h100"), zero3_overhead_s=1e-4), 64, 8),
        CALIBRATION.constants,
    )
    seq_len, global_batch, dtype = 4096, 256, "bfloat16"
    base = BASE.with_(zero=zero, **({"pp_schedule": "interleaved-1f1b", "pp_virtual": 2} if interleaved else {}))
    for name, value in {**CHANGED, **({"pp_virtual": 4, "pp_layers": "10,6,8,8"} if interleaved else {})}.items():
        for layout in (base, base.with_(**{name: value})):  # (the base first: the memos are warm)
            runtime = for_layout(FIVED, layout)
            for pp_rank in range(layout.pp):
                chunks, stages = rank_chunks(model, layout, pp_rank), rank_stages(layout, pp_rank)
                whole = step_collectives(model, layout, seq_len, global_batch, dtype, chunks, stages, runtime)
                want: tuple = (defaultdict(float), defaultdict(float))
                links.price_collectives(whole, layout, cluster, c, *want)
                mp = links.model_parallel_seconds(
                    model_key(model),
                    layout,
                    cluster,
                    seq_len,
                    global_batch,
                    dtype,
                    model_parallel_runtime(runtime),
                    c,
                    pp_rank,
                )
                got = (defaultdict(float, mp[0]), defaultdict(float, mp[1]))
                memo = links.data_parallel_seconds if layout.optimizer != "muon" else links.data_parallel_priced
                priced, host = memo(model_key(model), layout, cluster, global_batch, dtype, runtime, c, pp_rank)
                for part, seconds, group, nbytes in priced:
                    got[0][part] += seconds
                    got[1][group] += nbytes
                assert got == want, (zero, name, pp_rank)
                want_host = 0.0
                for x in whole if layout.zero == 3 else ():
                    if x.part and x.group in ("dp_shard_cp", "edp") and x.op != "all_reduce":
                        want_host += x.calls * cluster.hardware.zero3_overhead_s
                assert host == want_host and (want_host > 0) == (layout.zero == 3), (zero, name, pp_rank)
            chunks, stages = rank_chunks(model, layout, 0), rank_stages(layout, 0)
            merged = explore._merge(step_collectives(model, layout, seq_len, global_batch, dtype, chunks, stages), {})
            rows = explore.collectives(model, layout, cluster, seq_len, global_batch, dtype)
            assert rows == tuple(
                (g, op, round(n), round(k, 3), link(layout, g), group_spans(layout)[g][0], *members(layout, g))
                for (g, op), (n, k) in merged.items()
                if group_spans(layout)[g][0] > 1
            ), (zero, name)


def link(layout, group):
    from fived.planner.communication import group_spans
    from fived.planner.links import in_node

    size, stride = group_spans(layout)[group]
    return "NVLink" if in_node(8, stride, size) else "network"


def members(layout, group):
    """(the ranks of rank 0's group in the first model replica, how many are outside it), by hand."""
    ranks = layout.group_ranks(group, 0)
    inside = tuple(sorted(r for r in ranks if r // (layout.tp * layout.cp) % layout.dp == 0))
    return inside, len(ranks) - len(inside)


def test_a_search_pauses_the_cyclic_collector_and_hands_it_back_as_it_found_it():
    """`collector_paused`: off inside (what a search allocates holds no cycle), on again after, even when
    the search raises; left off where the caller had turned it off."""
    import gc

    from fived.planner.layout_cache import collector_paused

    assert gc.isenabled()
    with pytest.raises(ZeroDivisionError), collector_paused():
        assert not gc.isenabled()
        _ = 1 / 0
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("zero", [0, 2])
def test_busiest_compute_memo_keys_on_every_field_the_compute_reads(zero):
    """`timing.busiest_compute` (memoised on `compute_key`, with the runtime before `for_layout`) answers
    what `_busiest_compute` computes uncached on the layout's own runtime, for every field changed in
    turn after the base warmed it: a field the compute reads missing from `compute_key` fails here."""
    from fived.planner.hardware import Cluster, hardware
    from fived.planner.runtimes import for_layout
    from fived.planner.timing import CALIBRATION, _busiest_compute, busiest_compute

    model, cluster, c = model_preset("mixtral-8x7b"), Cluster(hardware("h100"), 32, 8), CALIBRATION.constants
    base = BASE.with_(zero=zero, checkpointing="selective")
    for name, value in CHANGED.items():
        for layout in (base, base.with_(**{name: value})):
            got = busiest_compute(model, layout, cluster, 4096, 64, "bfloat16", FIVED, c)
            want = _busiest_compute(model, layout, cluster, 4096, 64, "bfloat16", for_layout(FIVED, layout), c)
            assert got == want, name


def test_an_explore_messages_row_index_keeps_every_row_it_saw():
    """`MessageTables.row_index` finds a collective's row by the object's identity: a row equal to one
    seen before but another object (the memos make such), then dropped by its maker, must not lend
    its id to a new row (a fresh tuple of its size takes a freed one's address)."""
    from fived.tools.explore_tables import MessageTables

    tables = MessageTables()
    first = ("tp", "all_reduce", 100, 1.0, "NVLink", 2, (0, 1), 0)
    twin = first[:4] + first[4:]  # (equal, another object)
    assert twin is not first and tables.row_index(first) == tables.row_index(twin) == 0
    del twin
    for k in range(50):
        other = ("dp", "reduce_scatter", 999 + k, 2.0, "network", 8, (0, 8), 7)
        assert tables.rows.items[tables.row_index(other)] == other


def test_a_state_s_memory_is_each_activation_option_s_own():
    """The search prices a state's activation options (micro-batch size, sp, checkpointing) with one
    `StateMemory` of the state: each option's figures are those of a `StateMemory` of its own (what
    `memory_per_gpu` builds), so what the state's object looked up once depends on none of them."""
    from itertools import product

    model, seq, gb = model_preset("mixtral-8x7b"), 4096, 64
    for state in (BASE, BASE.with_(zero=3, pp_schedule="zbv"), BASE.with_(pp=1, zero=2, dp=8, tp_overlap=True)):
        shared = memory.StateMemory(model, state, seq, "bfloat16", 80.0, FIVED)
        for mbs, sp, ac in product((1, 2), (False, True), ("none", "selective", "full")):
            option = state.with_(micro_batch=mbs, sp=sp, checkpointing=ac)
            own = memory.memory_per_gpu(model, option, seq, gb, "bfloat16", 80.0, FIVED)
            assert shared.of(option, gb) == own, option


def test_the_search_s_memory_of_every_plan_is_its_own():
    """Through the search (ZeRO-2 with overlapped buckets has two reduction choices, each with its own
    state's `StateMemory`): every fitting plan's memory is `memory_per_gpu` of its layout; handing a
    choice the other's state would price its gradient buffers wrong."""
    from fived.planner.hardware import hardware
    from fived.planner.search import plan
    from fived.planner.timing import Cluster

    model, seq, gb = model_preset("llama3-8b"), 8192, 128
    plans = plan(model, Cluster(hardware("h100"), 16, 8), seq, gb, "bfloat16", FIVED, 3.0).plans
    both = [p for p in plans if p.layout.zero == 2 and p.layout.overlap_grad_reduce]
    assert {p.layout.zero2_reduce_every_microbatch for p in both} == {False, True}  # (both choices kept somewhere)
    for p in plans:
        assert p.memory == memory.memory_per_gpu(model, p.layout, seq, gb, "bfloat16", 80.0, FIVED), p.layout


def test_a_core_s_validity_is_each_layout_s_refusal():
    """The search asks a state's core once (`validity.CoreValidity`) and each activation option its own
    rules: it accepts an option iff `layout_refusal` finds nothing against it, as `is_valid` does, for
    options that break per-layout rules (sp without tp, selective checkpointing under split-backward
    schedules), the batch (micro-batches that do not divide it), the schedule's micro-batch rules, the
    core's rules, and another runtime's expert tensor parallelism (etp 2: Megatron-Core's rules)."""
    from collections import Counter
    from itertools import product

    from fived.planner.search import mesh_shapes, state_choices

    model, seq, global_batch = model_preset("mixtral-8x7b"), 4096, 12  # (12: micro-batches that do not divide it)
    seen: Counter = Counter()
    meshes = list(mesh_shapes(model, 16, 8, seq, global_batch, folded=True))
    meshes += [m.with_(etp=etp) for m in meshes for etp in (2, 4) if m.tp >= 2 and m.etp == 0]
    for mesh in meshes:
        for state in state_choices(model, mesh, 8):
            core = validity.CoreValidity(model, state, seq, global_batch)
            for mbs, sp, ac in product((1, 4), (False, True), ("none", "selective", "full")):
                option = state.with_(micro_batch=mbs, sp=sp, checkpointing=ac)
                refusal = validity.layout_refusal(model, option, seq, global_batch)
                accepted = core.accepts(option)
                assert accepted == (refusal is None) == validity.is_valid(model, option, seq, global_batch)
                seen[refusal.field if refusal else f"valid etp{option.etp}"] += 1
    assert min(seen[f"valid etp{etp}"] for etp in (0, 1, 2, 4)) > 0 and seen["etp"] > 0, seen  # (Megatron-Core's)
    assert {"parallel.sp", "train.microbatches", "train.activation_checkpointing", "micro_batch"} < set(seen), seen
