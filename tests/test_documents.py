"""Document masking (data.document_mask): the masked kernels against a dense-mask SDPA, documents
really isolated, the work-balanced context-parallel assignment, and `fived verify` exact (float64)
with masking under ring, Ulysses and hybrid context parallelism, TP+SP, PP and EP."""

import pytest
import torch

from fived.config import ConfigError
from fived.data.documents import balanced_chunks, chunk_assignment, document_structure, local_token_index, rank_work
from fived.data.loader import check_data
from fived.model import attention
from fived.model.init import init_weights
from fived.model.transformer import build_model, materialize
from fived.testing import EXACT, tiny_config, write_documents
from fived.tools.verification import run_verify


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("docs") / "docs.txt")


def test_document_structure():
    tokens = torch.tensor([[7, 0, 5, 6, 0, 0, 9], [1, 2, 3, 4, 5, 6, 7]])
    documents, positions = document_structure(tokens, 0)
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0] * 7]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0], list(range(7))]


def _dense_reference(q, k, v, documents, positions):
    """SDPA with the whole [s, s] boolean document mask (the definition)."""
    same = documents[:, :, None] == documents[:, None, :]
    allowed = same & (positions[:, None, :] <= positions[:, :, None])
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=True)
    return out.transpose(1, 2)


@pytest.mark.parametrize("tile,packed", [(4, 2), (8, 6), (512, 128)])
def test_masked_kernel_matches_dense_mask(tile, packed, monkeypatch):
    monkeypatch.setattr(attention, "QUERY_TILE", tile)  # several tiles per document, and one
    monkeypatch.setattr(attention, "PACKED_TILE", packed)
    gen = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d = 3, 40, 4, 2, 8
    tokens = (torch.rand(b, s, generator=gen) < 0.12).long()  # documents end at the 1s
    tokens[1] = 1  # a row of one-token documents
    tokens[2] = 0  # a row that is one document
    documents, positions = document_structure(tokens, 1)
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float64, generator=gen, requires_grad=True) for h in (hq, hkv, hkv))
    out = attention.document_attention(q, k, v, documents, positions)
    ref = _dense_reference(q, k, v, documents, positions)
    torch.testing.assert_close(out, ref, rtol=EXACT, atol=EXACT)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=EXACT, atol=EXACT)


def _model_outputs(tokens, documents=None, positions=None):
    cfg = tiny_config().model
    model = build_model(cfg, "meta", torch.float64)
    materialize(model, "cpu")
    init_weights(model, 0)
    with torch.no_grad():
        return model(tokens, positions=positions, documents=documents)


def test_masking_isolates_documents():
    """A token's output depends on its own document only: changing every token of the document
    before it (same length) leaves it bit for bit the same — and without masking it does not."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 256, (1, 48), generator=gen)
    tokens[0, 19] = 0  # the first document ends at 19; the second starts at 20
    other = tokens.clone()
    other[0, :19] = torch.randint(1, 256, (19,), generator=gen)
    masked = [_model_outputs(t, *document_structure(t, 0)) for t in (tokens, other)]
    assert torch.equal(masked[0][0, 20:], masked[1][0, 20:])
    assert not torch.equal(masked[0][0, :20], masked[1][0, :20])
    plain = [_model_outputs(t) for t in (tokens, other)]
    assert not torch.equal(plain[0][0, 20:], plain[1][0, 20:])


def test_balanced_assignment():
    # one long document then many short ones: the halves layout gives one rank ~3x the work
    tokens = torch.ones(1, 1024, dtype=torch.long)
    tokens[0, 512::16] = 0
    _, positions = document_structure(tokens, 0)
    halves, work = (rank_work(positions, chunk_assignment(positions, 2, b)) for b in ("halves", "work"))
    assert sum(halves) == sum(work)
    assert max(halves) / min(halves) > 2.5
    assert max(work) / min(work) < 1.1
    # every token held once, the same count per rank, each rank's in sequence order
    assignment = chunk_assignment(positions, 4, "work")
    held = [local_token_index(assignment, 1024, r)[0] for r in range(4)]
    assert sorted(torch.cat(held).tolist()) == list(range(1024))
    assert all(len(h) == 256 and torch.all(h[1:] > h[:-1]) for h in held)
    # deterministic; ties broken by chunk index
    assert balanced_chunks([5, 5, 1, 1], 2) == [[0, 2], [1, 3]]


def test_document_mask_needs_an_end_of_document_token(tmp_path):
    check_data(
        tiny_config(data__document_mask=True, data__path=write_documents(tmp_path / "docs.txt"))
    )  # (NUL ends each)
    with pytest.raises(ConfigError, match="holds no end-of-document token") as e:
        check_data(tiny_config(data__document_mask=True))  # the bundled corpus: one document
    assert "\n" not in str(e.value) and "masking would change nothing" in str(e.value)
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a b c d"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    text = tmp_path / "text.txt"
    text.write_text("a b c d " * 400)
    cfg = tiny_config(data__document_mask=True, data__tokenizer=str(tmp_path / "tokenizer.json"), data__path=str(text))
    with pytest.raises(ConfigError, match="no end-of-document token") as e:
        check_data(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "over,field",
    [
        (dict(parallel__cp_mode="spiral"), "parallel.cp_mode"),
        (dict(parallel__cp_balance="even"), "parallel.cp_balance"),
        (dict(parallel__cp_mode="hybrid", parallel__cp_ulysses=3), "parallel.cp_ulysses"),
        (dict(parallel__cp_mode="hybrid", parallel__cp_ulysses=4), "parallel.cp_ulysses"),
        (dict(parallel__cp_mode="ulysses", parallel__cp=8, parallel__dp=1), "parallel.cp"),  # 4 heads over 8 ranks
        (dict(parallel__cp_mode="ulysses", parallel__tp=4, parallel__cp=2, parallel__dp=1), "parallel.cp"),
    ],
)
def test_cp_mode_rules(over, field):
    from fived.layout.rules import check_config

    over = {"parallel__cp": 4, "parallel__dp": 1, **over}
    with pytest.raises(ConfigError) as e:  # (an unknown choice is refused as the config is built)
        cfg = tiny_config(**over)
        check_config(cfg, cfg.parallel.tp * cfg.parallel.cp)
    assert e.value.field == field and e.value.hint, str(e.value)


def _verify(world, model, docs, **over):
    cfg = tiny_config(model, train__steps=2, data__path=docs, data__document_mask=True, **over)
    report = run_verify(cfg, world, printer=lambda *_: None)
    assert report.max_relative_difference <= EXACT, report.max_rel
    return report


LAYOUTS = {
    "cp2-ring": ("tiny", 2, dict(parallel__dp=1, parallel__cp=2, train__eval_every=1)),
    "cp2-ring-halves": ("tiny", 2, dict(parallel__dp=1, parallel__cp=2, parallel__cp_balance="halves")),
    "cp2-ulysses": ("tiny", 2, dict(parallel__dp=1, parallel__cp=2, parallel__cp_mode="ulysses")),
    "cp4-hybrid": ("tiny", 4, dict(parallel__dp=1, parallel__cp=4, parallel__cp_mode="hybrid", parallel__cp_ulysses=2)),
    "tp2-sp-cp2-ulysses": (
        "tiny",
        4,
        dict(parallel__dp=1, parallel__tp=2, parallel__sp=True, parallel__cp=2, parallel__cp_mode="ulysses"),
    ),
    "pp2-cp2": (
        "tiny",
        4,
        dict(parallel__dp=1, parallel__pp=2, parallel__cp=2, train__microbatches=2, train__eval_every=1),
    ),
    "ep2-cp2-moe": ("tiny-moe", 2, dict(parallel__dp=1, parallel__cp=2, parallel__ep=2)),
    "dp2-tp2-sp": ("tiny", 4, dict(parallel__dp=2, parallel__tp=2, parallel__sp=True, parallel__zero=1)),
    "cp2-selective": ("tiny", 2, dict(parallel__dp=1, parallel__cp=2, train__activation_checkpointing="selective")),
    "dp2-full": ("tiny", 2, dict(parallel__dp=2, train__activation_checkpointing="full", train__microbatches=2)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_document_masked_layout_matches_reference(layout, documents):
    model, world, over = LAYOUTS[layout]
    if over.get("train__eval_every"):
        over = {**over, "data__val_path": documents}
    report = _verify(world, model, documents, **over)
    if over.get("train__eval_every"):
        assert "val_loss" in report.max_rel


@pytest.mark.parametrize(
    "world,over",
    [
        (2, dict(parallel__cp=2)),
        (2, dict(parallel__cp=2, parallel__cp_mode="ulysses")),
        (4, dict(parallel__cp=4, parallel__cp_mode="ulysses")),  # 2 kv heads repeated for 4 ranks
        (4, dict(parallel__cp=4, parallel__cp_mode="hybrid")),
        (4, dict(parallel__cp=2, parallel__tp=2, parallel__cp_mode="ulysses", train__activation_checkpointing="full")),
    ],
    ids=["ring", "ulysses", "ulysses4", "hybrid", "tp2-ulysses-full"],
)
@pytest.mark.parametrize("masked", [True, False], ids=["documents", "causal"])
def test_cp_traffic_is_the_planner_formula(world, over, masked, documents):
    """Every byte the cp modes move (ring hops with their order keys, Ulysses' all-to-alls and key
    gathers, hybrid's both), as the ledger records them, equals the planner's formula on every rank."""
    from fived.testing import run_on_ranks
    from fived.training.report import expected_comm_bytes
    from fived.training.trainer import run_training

    cfg = tiny_config(
        "tiny",
        train__steps=1,
        parallel__dp=1,
        data__path=documents,
        data__document_mask=masked,
        train__global_batch=4,
        **over,
    )
    results = run_on_ranks(world, run_training, cfg, False, False)
    for rank, r in enumerate(results):
        measured = {k: v["bytes"] for k, v in r.comm.items()}
        assert measured == expected_comm_bytes(cfg, world, rank), rank
