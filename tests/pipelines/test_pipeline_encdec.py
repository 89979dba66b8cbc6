"""Pipeline stages of models with several layer sequences (T5, Bart, a plain two-stack
model), in one process: cuts inside the encoder, between encoder and decoder and inside the
decoder; the stages chained equal the model's output and every parameter gradient; what
crosses a boundary; what is refused, and how."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from encdec_models import CUTS, MODELS, TwoStacks, t5
from models import VOCAB, token_ids
from torch import nn

import slapo_fn as sf
from slapo_fn.pipelines import build_stages, split_stages, stage_table
from slapo_fn.pipelines.chain import Placeholder, Replay, find_chain
from slapo_fn.pipelines.families import NotInStage


def _inputs(kind: str) -> tuple[torch.Tensor, dict[str, Any]]:
    ids = token_ids(2, 7, seed=3)
    if kind == "two-stacks":
        return ids, {}
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0  # padding: the encoder mask is recomputed in every stage that reads it
    return ids, {"attention_mask": mask, "decoder_input_ids": token_ids(2, 5, seed=4)}


def _logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def _cut(kind: str, cuts: str) -> tuple[nn.Module, sf.Schedule]:
    make, *seqs = MODELS[kind]
    model = make().eval()
    sch = sf.cut_pipeline_stage(sf.create_schedule(model), [f"{seqs[s]}.{k}" for s, k in CUTS[cuts]])
    return model, sch


@pytest.mark.parametrize(("kind", "cuts"), [(k, c) for k in ("t5", "bart") for c in sorted(CUTS)] + [
    ("two-stacks", "four")])
def test_chained_stages_equal_the_model_loss_and_every_gradient(kind: str, cuts: str) -> None:
    model, sch = _cut(kind, cuts)
    ids, kwargs = _inputs(kind)
    expected = _logits(model(ids, **kwargs))
    expected.square().mean().backward()
    stages = build_stages(sch)
    assert len(stages) == len(CUTS[cuts]) + 1
    out: Any = stages[0](ids, **kwargs)
    for stage in list(stages.values())[1:]:
        out = stage(*out, input_ids=ids, **kwargs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.square().mean().backward()
    first: dict[int, str] = {}
    canon = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
    grads: dict[str, torch.Tensor] = {}
    for stage in stages.values():  # a parameter several stages hold (tied, recomputed): its gradients sum
        for name, p in stage.named_parameters():
            if p.grad is not None:
                key = canon[name]
                grads[key] = grads[key] + p.grad if key in grads else p.grad
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert want.keys() <= grads.keys()
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_t5_decoder_stage_replays_what_earlier_stages_ran_and_hands_on_the_biases() -> None:
    model, sch = _cut("t5", "decoder")
    first, second = split_stages(sch)
    assert first.layer_paths == ("encoder.block.0", "encoder.block.1", "decoder.block.0")
    assert second.layer_paths == ("decoder.block.1", "decoder.block.2")
    tree = second.schedule.module
    # the encoder's last layer and the decoder's last earlier one are replayed, under their own keys
    assert isinstance(tree.encoder.block._modules["1"], Replay) and list(tree.encoder.block._modules) == ["1"]
    assert list(tree.decoder.block._modules) == ["0", "1", "2"]
    assert isinstance(tree.decoder.block._modules["0"], Replay)
    # embeddings whose output a replay replaces hold no table; the encoder's final norm is recomputed
    assert isinstance(tree.encoder.embed_tokens, Placeholder) and isinstance(tree.decoder.embed_tokens, Placeholder)
    assert tree.encoder.final_layer_norm is model.encoder.final_layer_norm
    assert isinstance(first.schedule.module.lm_head, NotInStage)
    # what crosses: the encoder's last output (hidden states, self-attention bias, one for the batch) and the
    # decoder's (hidden states, self-attention bias, cross-attention bias)
    ids, kwargs = _inputs("t5")
    sent = build_stages(sch, indices=(0,))[0](ids, **kwargs)
    assert [tuple(t.shape) for t in sent] == [(2, 7, 32), (1, 4, 7, 7), (2, 5, 32), (1, 4, 5, 5), (1, 4, 5, 7)]
    # original FQNs: the stages hold every parameter of the model between them
    names = {n for st in split_stages(sch) for n, _ in st.schedule.module.named_parameters(remove_duplicate=False)}
    assert names == {n for n, _ in model.named_parameters(remove_duplicate=False)}


def test_the_chain_is_found_in_call_order_with_what_each_sequence_returns() -> None:
    chain = find_chain(t5())
    assert chain.sequences == ("encoder.block", "decoder.block")
    assert chain.layouts == ((True, True, False), (True, True, True))
    assert find_chain(TwoStacks()).layouts == (None, None)


def test_explain_shows_the_stages_of_an_encoder_decoder() -> None:
    _, sch = _cut("bart", "four")
    table = stage_table(sch)
    assert [r.layers for r in table.rows] == [
        ("model.encoder.layers.0",), ("model.encoder.layers.1",), ("model.decoder.layers.0", "model.decoder.layers.1"),
        ("model.decoder.layers.2",)]
    text = str(sf.explain(sch))
    assert "pipeline stages (4):" in text
    assert "model.encoder.layers.1, model.decoder.layers.0" not in text  # stage 1 alone holds encoder layer 1
    assert "model.decoder.layers.[0-1]" in text
    _, two = _cut("bart", "decoder")
    assert "model.encoder.layers.[0-1], model.decoder.layers.0" in str(stage_table(two))


def test_cuts_out_of_call_order_and_after_the_last_layer_are_refused_all_at_once() -> None:
    _, sch = _cut("t5", "decoder")
    with pytest.raises(sf.ScheduleError) as info:
        sf.cut_pipeline_stage(sch, ["encoder.block.0", "decoder.block.2", "decoder.block.0"])
    reasons = [(p.path, p.reason) for p in info.value.problems]
    assert reasons[0][0] == "encoder.block.0" and "out of order" in reasons[0][1]
    assert reasons[1][0] == "decoder.block.2" and "last layer call the forward makes" in reasons[1][1]
    assert reasons[2][0] == "decoder.block.0" and "cut already" in reasons[2][1]
    with pytest.raises(sf.ScheduleError, match="is not a layer of the model's layer sequences"):
        sf.cut_pipeline_stage(sch, "encoder.block.0.layer.0")


def test_a_model_with_two_stacks_whose_forward_takes_no_token_ids_is_refused_with_the_reason() -> None:
    class NoIds(TwoStacks):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x)

    with pytest.raises(sf.ScheduleError, match=r"(?s)'a, b'.*forward takes no input_ids.*fix: pipeline one"):
        sf.cut_pipeline_stage(sf.create_schedule(NoIds()), "a.0")


def _albert(**overrides: int) -> nn.Module:
    from transformers import AlbertConfig, AlbertForMaskedLM

    torch.manual_seed(0)
    return AlbertForMaskedLM(AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=4,
                                          num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0, **overrides)).eval()


@pytest.mark.parametrize(("overrides", "cut", "calls"), [
    ({}, "albert.encoder.albert_layer_groups.0", 1),  # one shared layer, called 4 times: 2 stages
    ({}, "albert.encoder.albert_layer_groups.0", (0, 1, 2)),  # a stage per call
    ({"num_hidden_groups": 2}, "albert.encoder.albert_layer_groups.[0,1]", 0),  # two groups, each called twice
])
def test_albert_is_cut_between_calls_of_its_shared_layer(overrides: dict[str, int], cut: str,
                                                         calls: int | tuple[int, ...]) -> None:
    model = _albert(**overrides)
    sch = sf.cut_pipeline_stage(sf.create_schedule(model), cut, calls=calls)
    stages = build_stages(sch)
    assert len(stages) == (len(calls) if isinstance(calls, tuple) else cut.count(",") + 1) + 1
    ids = token_ids(2, 7, seed=3)
    expected = model(ids).logits
    expected.square().mean().backward()
    out: Any = stages[0](ids)
    for stage in list(stages.values())[1:]:
        out = stage(*out, input_ids=ids)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.square().mean().backward()
    grads: dict[str, torch.Tensor] = {}
    for stage in stages.values():  # the shared layer's gradients: summed over the stages that call it
        for name, p in stage.named_parameters():
            if p.grad is not None:
                grads[name] = grads[name] + p.grad if name in grads else p.grad
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_albert_cut_without_calls_or_with_calls_it_lacks_is_refused_with_the_fix() -> None:
    sch = sf.create_schedule(_albert())
    with pytest.raises(sf.ScheduleError, match=r"only layer of its sequence.*\n.*calls=1\) starts a stage after"):
        sf.cut_pipeline_stage(sch, "albert.encoder.albert_layer_groups.0")
    with pytest.raises(sf.ScheduleError, match=r"calls=\[4\]: the forward calls it 4 time\(s\)"):
        sf.cut_pipeline_stage(sch, "albert.encoder.albert_layer_groups.0", calls=4)
    with pytest.raises(sf.ScheduleError, match=r"\(call 3\)': is the last layer call the forward makes"):
        sf.cut_pipeline_stage(sch, "albert.encoder.albert_layer_groups.0", calls=3)
    once = sf.cut_pipeline_stage(sch, "albert.encoder.albert_layer_groups.0", calls=0)
    with pytest.raises(sf.ScheduleError, match=r"\(call 0\)': is cut already"):
        sf.cut_pipeline_stage(once, "albert.encoder.albert_layer_groups.0", calls=0)
    assert "albert.encoder.albert_layer_groups.0 ×3" in str(stage_table(once))
    twice = sf.cut_pipeline_stage(once, "albert.encoder.albert_layer_groups.0", calls=2)
    cut = twice["albert.encoder.albert_layer_groups.0"].annotations["pipeline_cut"]
    assert str(cut) == "stage cut after calls 0, 2"
    assert len(split_stages(twice)) == 3


def test_a_meta_encoder_decoder_is_probed_through_a_narrow_twin_of_the_same_depth() -> None:
    import transformers as t

    config = t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=5, num_decoder_layers=4,
                        num_heads=4, decoder_start_token_id=0)
    with torch.device("meta"):
        model = t.T5ForConditionalGeneration(config)
    sch = sf.cut_pipeline_stage(sf.create_schedule(model), ["encoder.block.3", "decoder.block.1"])
    assert [s.layer_paths for s in split_stages(sch)] == [
        tuple(f"encoder.block.{i}" for i in range(4)), ("encoder.block.4", "decoder.block.0", "decoder.block.1"),
        ("decoder.block.2", "decoder.block.3")]
