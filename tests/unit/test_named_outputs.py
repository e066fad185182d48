"""Named encoder outputs through the router, generic (no family's word): ``Encoder.outputs`` /
``LanguageModel.inputs`` (``dhp.models.spec``), the engines' handover, the p2p data plane's packing.

A toy family of the tests (``tests.toy_named``) has an audio encoder of two outputs, ``embeds`` (float32,
width D) and ``extra`` (float64, width 5), both consumed by its language model. Checked here without Ray:
the spec's rules and refusals; the data plane packs, splits and cuts (Megatron SP slices) every named part the
same way, in its own dtype and width, and counts every part's bytes; and the engines' round trip (encoder
forward, language forward-backward, encoder backward from the gradients by name) gives the encoder exactly the
parameter gradients of one autograd graph through both modules, the ``extra`` head's included. The Ray run of
the same family is ``tests/distributed/test_family_parity.py``.
"""

from __future__ import annotations

import pytest
import torch

from dhp.models.spec import EMBEDS, Encoder, Input, LanguageModel
from dhp.runtime.data_plane import Incoming, output_layout, pack_rows, rows_by_receiver, split_rows
from tests.toy_audio import write_audio_data
from tests.toy_named import EXTRA, EXTRA_DTYPE, EXTRA_WIDTH, NAMED_FAMILY


class Two(Encoder):
    name = "two"

    def outputs(self, model_cfg: object) -> tuple[str, ...]:
        return (EMBEDS, "side")


def test_named_outputs_rule_and_refusals() -> None:
    one, two = Encoder(), Two()
    t = torch.zeros(3, 4)
    assert one.named_outputs(t, None) == {EMBEDS: t}  # a one-output encoder returns its tensor
    got = two.named_outputs({"side": t[:, :1], EMBEDS: t}, None)
    assert list(got) == [EMBEDS, "side"]  # in the declared order (the order the wire carries)
    with pytest.raises(ValueError, match="returned one tensor"):
        two.named_outputs(t, None)
    with pytest.raises(ValueError, match=r"returned \['embeds'\]"):
        two.named_outputs({EMBEDS: t}, None)
    with pytest.raises(ValueError, match="one row per placeholder token"):
        two.named_outputs({EMBEDS: t, "side": t[:2]}, None)
    lang = LanguageModel()
    assert lang.handover({EMBEDS: t}, None) is t  # one input: the tensor itself (Qwen2.5-VL, Omni unchanged)
    with pytest.raises(ValueError, match=r"encoder 'two' emits \['embeds', 'side'\]"):
        lang.check_outputs((two,), None)
    lang.inputs = lambda cfg: (Input(EMBEDS), Input("side", after_layer=0))  # type: ignore[method-assign]
    lang.check_outputs((one, two), None)  # an encoder may emit fewer than the module takes
    assert lang.handover({EMBEDS: t}, None) == {EMBEDS: t}


def _pieces() -> dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Two samples' rows of a two-output encoder: embeds [n, 3] float32, extra [n, 5] float64."""
    def named(base: float, n: int) -> dict[str, torch.Tensor]:
        rows = base + torch.arange(float(n))[:, None]
        return {EMBEDS: rows.repeat(1, 3), EXTRA: -rows.repeat(1, EXTRA_WIDTH).to(EXTRA_DTYPE)}
    return {0: (torch.tensor([0, 3, 5]), named(0.0, 3)), 1: (torch.tensor([1, 2]), named(10.0, 2))}


def test_the_data_plane_moves_every_named_part_in_its_own_dtype() -> None:
    pieces = _pieces()
    counts, index, rows = pack_rows(pieces, [1, 0], torch.device("cpu"))
    assert counts == ((1, 2), (0, 3)) and index.tolist() == [1, 2, 0, 3, 5]
    assert output_layout(rows) == ((EMBEDS, 3, "float32"), (EXTRA, EXTRA_WIDTH, "float64"))  # no common width
    back = split_rows(counts, index, rows)
    for sid, (token_index, named) in pieces.items():
        assert torch.equal(back[sid][0], token_index)
        assert all(torch.equal(back[sid][1][n], t) and back[sid][1][n].dtype == t.dtype for n, t in named.items())
    inc = Incoming("audio", 3, counts, output_layout(rows))
    assert inc.nbytes == 5 * (8 + 3 * 4 + EXTRA_WIDTH * 8)  # the index and every part, nothing padded
    assert inc.nbytes == index.numel() * 8 + sum(t.numel() * t.element_size() for t in rows.values())
    # Megatron SP: sample 0 at [0, 10), sample 1 at [10, 16); slots in token-index order; slices [0, 8), [8, 16)
    slots = {0: torch.tensor([1, 2, 4, 8, 5, 6]), 1: torch.tensor([0, 1, 5])}
    got = rows_by_receiver(pieces, [0, 1], {0: 0, 1: 10}, slots, [(40, 0, 8), (41, 8, 16)], torch.device("cpu"))
    for (_, _, _, named), want in zip(got, ([0.0, 2.0], [1.0, 10.0, 11.0]), strict=True):
        assert named[EMBEDS][:, 0].tolist() == want and named[EMBEDS].shape[-1] == 3
        assert (-named[EXTRA][:, 0]).tolist() == want and named[EXTRA].dtype == EXTRA_DTYPE  # cut the same way
    assert [(r, c, i.tolist()) for r, c, i, _ in got] == [(40, ((0, 2),), [0, 5]), (41, ((0, 1), (1, 2)), [3, 1, 2])]


@pytest.fixture(scope="module")
def named_run(demo_data, tmp_path_factory):
    from dhp.config import load_config
    from dhp.inputs import prepare
    from dhp.models.registry import register_family

    register_family(NAMED_FAMILY)
    out = tmp_path_factory.mktemp("named")
    data = write_audio_data(demo_data.train, demo_data.root, out / "audio.jsonl", n=8)
    cfg = load_config(None, [f"data.path={data}", f"data.tokenizer={demo_data.tokenizer}", "data.max_pixels=12544",
                             "model.family=toy_named_audio", f"output.dir={out / 'run'}", "train.optimizer=sgd"])
    return prepare(cfg)


def test_engines_return_each_named_gradient_to_the_encoder(named_run) -> None:
    """Encoder forward -> language forward_backward -> encoder backward (the local backend's path) gives the audio
    encoder the parameter gradients of one autograd graph through both modules: the ``extra`` head's (reached only
    through the ``extra`` output's gradient) and the shared layers' (reached through both)."""
    from dhp.data.batch import pack
    from dhp.engine import EncoderEngine, LanguageEngine

    run = named_run
    family, mcfg, cfg, get = run.inputs.family, run.inputs.model_cfg, run.inputs.cfg, run.dataset.get
    audio = family.module("audio")
    ids = [i for i in range(len(run.dataset)) if audio.num_placeholders(get(i), mcfg)][:2]
    ids += [next(i for i in range(len(run.dataset)) if not audio.num_placeholders(get(i), mcfg))]  # text only
    enc = EncoderEngine(audio, family, mcfg, cfg, get)
    vision = EncoderEngine(family.module("vision"), family, mcfg, cfg, get)
    lang = LanguageEngine(family, mcfg, cfg, get)
    pieces = {"audio": {i: [p] for i, p in enc.forward(0, ids).items()},
              "vision": {i: [p] for i, p in vision.forward(0, ids).items()}}
    assert {n: (t.shape[-1], t.dtype) for n, t in pieces["audio"][ids[0]][0][1].items()} == {
        EMBEDS: (mcfg.text.hidden_size, torch.float32), EXTRA: (EXTRA_WIDTH, EXTRA_DTYPE)}
    loss, _, grads = lang.forward_backward(ids, pieces)
    assert set(grads["audio"][ids[0]]) == {EMBEDS, EXTRA} and grads["audio"][ids[0]][EXTRA].abs().max() > 0
    enc.backward(0, grads["audio"])
    routed = {n: p.grad.clone() for n, p in enc.module.named_parameters()}

    # the same through one graph: the encoder's outputs (not detached) placed as the language engine places them
    samples = [get(i) for i in ids]
    carrying = [s for s in samples if audio.num_placeholders(s, mcfg)]
    enc.module.zero_grad()
    out, _ = audio.encode(enc.module, carrying, None, "cpu")
    batch = pack([get(i, pixels=False) for i in ids])
    meta = batch.meta(family.placeholder_ids(mcfg))
    vis = {t: lang.definition.handover({EMBEDS: v}, mcfg) for t, v in _vision_media(vision, pieces, ids, mcfg).items()}
    media = {**vis, mcfg.audio_token_id: lang.definition.handover({n: t.float() for n, t in out.items()}, mcfg)}
    ref = lang.module.loss_sum(batch.input_ids, batch.position_ids, batch.targets, media, batch.cu_seqlens,
                               meta=meta)
    ref.backward()
    assert abs(ref.item() - loss.item()) < 1e-5 * abs(ref.item())
    assert routed["extra.weight"].abs().max() > 0  # the extra head learns only through the extra output
    for name, p in enc.module.named_parameters():
        assert torch.allclose(routed[name], p.grad, rtol=1e-5, atol=1e-7), name


def _vision_media(vision, pieces, ids: list[int], mcfg) -> dict[int, torch.Tensor]:
    """The vision engine's main embeddings per placeholder id (whole samples, in sample order), detached."""
    fwd = {i: p[0] for i, p in pieces["vision"].items()}
    ids_v = vision.definition.placeholder_ids(mcfg)
    per_id: dict[int, list[torch.Tensor]] = {t: [] for t in ids_v}
    for i in ids:
        if i not in fwd:
            continue
        rows = fwd[i][1][EMBEDS]
        counts = vision.definition.placeholder_counts(vision.load(i), mcfg)
        for t, part in zip(ids_v, rows.split(list(counts)), strict=True):
            per_id[t].append(part)
    return {t: torch.cat(parts) for t, parts in per_id.items() if parts}


def test_gradients_back_in_parts_equal_whole_ones(named_run) -> None:
    """``EncoderEngine.backward_parts``: a sample's gradient rows handed back in pieces, in any order (under
    Megatron SP a sample that straddles two text ranks' slices gets its gradients from both) give the parameter
    gradients that its whole rows give (``backward``), for every named output; rows missing are an error naming
    the sample."""
    from dhp.engine import EncoderEngine

    run = named_run
    family, mcfg, cfg, get = run.inputs.family, run.inputs.model_cfg, run.inputs.cfg, run.dataset.get
    audio = family.module("audio")
    ids = [i for i in range(len(run.dataset)) if audio.num_placeholders(get(i), mcfg)][:2]
    enc = EncoderEngine(audio, family, mcfg, cfg, get)
    gen = torch.Generator().manual_seed(3)
    pieces = enc.forward(0, ids)
    whole = {sid: {n: torch.randn(audio.num_placeholders(get(sid), mcfg), t.shape[-1], generator=gen).to(t.dtype)
                   for n, t in named.items()} for sid, (_, named) in pieces.items()}
    enc.backward(0, whole)
    want = {n: p.grad.clone() for n, p in enc.module.named_parameters()}

    enc.module.zero_grad()
    parts = []
    for sid, (token_index, _) in enc.forward(1, ids).items():
        order = torch.randperm(len(token_index), generator=gen)
        for half in (order[len(order) // 3:], order[:len(order) // 3]):  # two pieces, out of order
            at = token_index[half]
            parts.append((sid, at, {n: g[at] for n, g in whole[sid].items()}))
    enc.backward_parts(1, parts[::-1])
    for name, p in enc.module.named_parameters():
        assert torch.allclose(want[name], p.grad, rtol=1e-5, atol=1e-7), name
    assert want["extra.weight"].abs().max() > 0

    enc.forward(2, ids)
    with pytest.raises(RuntimeError, match=rf"wrong rows.*{parts[0][0]}"):
        enc.backward_parts(2, parts[1:])
