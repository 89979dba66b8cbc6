"""build: private copy, canonical order, meta materialisation, init, state dicts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slapo_fn as sf
from tests.fingerprint import fingerprint, same
from tests.models import MLP, Net, tiny_gpt2, tiny_llama, token_ids


def test_build_never_touches_the_schedule_or_the_original() -> None:
    model = Net(depth=2)
    sch = sf.checkpoint(sf.create_schedule(model), "blocks.0")
    sch = sf.compile(sch, "blocks.1.mlp.act", backend="eager")
    sch = sf.hook(sch, "blocks.1", "fwd_post", lambda m, a, o: o)
    before = fingerprint(model)
    built = sf.build(sch)
    built(torch.randint(0, 16, (2, 4))).sum().backward()
    torch.optim.SGD(built.parameters(), lr=1.0).step()
    assert same(before, fingerprint(model))
    assert all(p.grad is None for p in model.parameters())


def test_copy_false_aliases_storage_but_not_parameter_objects() -> None:
    model = MLP()
    built = sf.build(sf.create_schedule(model), copy=False)
    assert built.fc1.weight is not model.fc1.weight
    assert built.fc1.weight.data_ptr() == model.fc1.weight.data_ptr()
    built(torch.randn(1, 8)).sum().backward()
    assert model.fc1.weight.grad is None and built.fc1.weight.grad is not None


def test_canonical_order_whatever_order_the_rewrites_were_written() -> None:
    model = Net(depth=2)
    log_a: list[str] = []
    log_b: list[str] = []
    hook_a = lambda m, a: log_a.append("h")
    hook_b = lambda m, a: log_b.append("h")
    a = sf.chain(sf.checkpoint.at("blocks.0"), sf.hook.at("blocks.0.mlp", "fwd_pre", hook_a),
                 sf.replace.at("blocks.0.mlp.act", nn.Tanh()))(sf.create_schedule(model))
    b = sf.chain(sf.replace.at("blocks.0.mlp.act", nn.Tanh()), sf.hook.at("blocks.0.mlp", "fwd_pre", hook_b),
                 sf.checkpoint.at("blocks.0"))(sf.create_schedule(model))
    ids = torch.randint(0, 16, (2, 4))
    out_a, out_b = sf.build(a)(ids), sf.build(b)(ids)
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
    out_a.sum().backward()
    out_b.sum().backward()
    assert log_a == log_b == ["h", "h"]  # forward + recomputation: the hook sits inside the checkpoint


def test_disjoint_rewrites_commute() -> None:
    model = Net(depth=3)
    rw1 = sf.replace.at("blocks.0.mlp.act", lambda old, path: nn.ReLU())
    rw2 = sf.checkpoint.at("blocks.2")
    rw3 = sf.replace.at("blocks.1.norm", lambda old, path: nn.Identity())
    ab = (rw1 >> rw2 >> rw3)(sf.create_schedule(model))
    ba = (rw3 >> rw2 >> rw1)(sf.create_schedule(model))
    assert ab.annotations == ba.annotations
    assert [(p, type(m)) for p, m in ab.module.named_modules()] == [(p, type(m)) for p, m in ba.module.named_modules()]
    assert ab.module.blocks[2] is ba.module.blocks[2] is model.blocks[2]
    ids = torch.randint(0, 16, (2, 4))
    torch.testing.assert_close(sf.build(ab)(ids), sf.build(ba)(ids), rtol=0, atol=0)


def _meta_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            use_cache=False, tie_word_embeddings=True))


def test_meta_build_full_init_is_seeded_and_layout_independent() -> None:
    meta = _meta_llama()
    plain = sf.build(sf.create_schedule(meta), init="full", seed=3)
    scheduled = sf.build(sf.checkpoint(sf.create_schedule(meta), "model.layers.*"), init="full", seed=3)
    other_seed = sf.build(sf.create_schedule(meta), init="full", seed=4)
    for (n, a), (_, b), (_, c) in zip(plain.state_dict().items(), scheduled.state_dict().items(),
                                      other_seed.state_dict().items()):
        assert torch.equal(a, b), n
        if n.endswith("q_proj.weight"):
            assert not torch.equal(a, c)
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    assert not any(t.is_meta for t in (*plain.parameters(), *plain.buffers()))
    assert all(p.is_meta for p in meta.parameters())
    torch.testing.assert_close(plain.model.rotary_emb.inv_freq, tiny_llama().model.rotary_emb.inv_freq)
    assert plain.model.norm.weight.eq(1).all()  # HF init: norms are ones


def test_meta_build_loads_a_full_hf_state_dict() -> None:
    real = tiny_llama(tie_word_embeddings=True)
    built = sf.build(sf.checkpoint(sf.create_schedule(_meta_llama()), "model.layers.0"), init="reset")
    built.load_state_dict(real.state_dict())
    ids = token_ids()
    torch.testing.assert_close(built(ids).logits, real(ids).logits)


def test_meta_build_with_callable_init_and_device() -> None:
    seen: list[str] = []

    def init(module: nn.Module, path: str) -> None:
        seen.append(path)
        for p in module.parameters(recurse=False):
            nn.init.constant_(p, 0.5)

    with torch.device("meta"):
        model = MLP()
    built = sf.build(sf.create_schedule(model), init=init, device="cpu")
    assert seen == ["fc1", "fc2"]
    assert built.fc1.weight.device.type == "cpu" and built.fc1.weight.eq(0.5).all()


def test_meta_build_errors() -> None:
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(2, device="meta"))

    with pytest.raises(sf.ScheduleError, match=r"(?s)'w1'.*no way to initialise.*fix: pass init=fn"):
        sf.build(sf.create_schedule(nn.ModuleDict({"w1": Bare(), "ok": nn.Linear(2, 2, device="meta")})))
    with pytest.raises(sf.ScheduleError, match="unknown init 'zeros'"):
        sf.build(sf.create_schedule(nn.Linear(2, 2, device="meta")), init="zeros")  # type: ignore[arg-type]
    with pytest.raises(sf.ScheduleTypeError, match="expected a Schedule"):
        sf.build(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_load_full_state_dict_into_scheduled_build() -> None:
    gpt2 = tiny_gpt2()
    sch = sf.checkpoint(sf.create_schedule(gpt2), "transformer.h.*")
    built = sf.build(sch)
    state = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in gpt2.state_dict().items()}
    built.load_state_dict(state)
    assert torch.equal(built.transformer.h[0].attn.c_attn.weight, state["transformer.h.0.attn.c_attn.weight"])
    assert built.lm_head.weight is built.transformer.wte.weight


def _t5_config() -> object:
    from transformers import T5Config

    return T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
                    use_cache=False, decoder_start_token_id=0)


def _gpt2_config() -> object:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=128, n_embd=64, n_head=4, n_layer=2, n_positions=32, use_cache=False)


@pytest.mark.parametrize("config", [_t5_config, _gpt2_config], ids=["t5", "gpt2"])
def test_meta_build_initialises_as_hugging_face_does(config: object) -> None:
    """``_init_weights`` branches on parents that own no tensors (T5's attention sizes q/k/v/o
    by the head size; GPT-2's blocks scale their residual projections by depth): a model
    built from meta gets the spread of each weight that the model made on a device has."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    cfg = config()  # type: ignore[operator]
    auto = AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else AutoModelForCausalLM  # type: ignore[attr-defined]
    torch.manual_seed(0)
    made = auto.from_config(cfg)
    with torch.device("meta"):
        meta = auto.from_config(cfg)
    for init in ("full", "reset"):
        built = dict(sf.build(sf.create_schedule(meta), init=init).named_parameters())
        for name, want in made.named_parameters():
            got, want = built[name].detach(), want.detach()
            if want.std() == 0:  # norms' ones, zero biases
                assert torch.equal(got, want), (init, name)
            elif want.numel() >= 1024:  # spreads estimated within a few percent
                assert 0.85 < float(got.std() / want.std()) < 1.15, (init, name, float(got.std()), float(want.std()))


def test_meta_build_leaves_real_weights_under_a_meta_parent_alone() -> None:
    from transformers import T5ForConditionalGeneration

    with torch.device("meta"):
        meta = T5ForConditionalGeneration(_t5_config())  # type: ignore[arg-type]
    real = nn.Linear(64, 64, bias=False)
    attention = meta.encoder.block[0].layer[0].SelfAttention
    attention.q = real  # a real child: its parent's branch (which sizes q by the head size) must not overwrite it
    built = sf.build(sf.create_schedule(meta), init="full")
    assert torch.equal(built.encoder.block[0].layer[0].SelfAttention.q.weight, real.weight)
    assert not any(t.is_meta for t in built.parameters())
