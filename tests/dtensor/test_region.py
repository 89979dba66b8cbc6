"""The region code runs in on DTensor activations (slapo_fn/dtensor/region.py)."""

from __future__ import annotations

import pytest
import torch
from dist import mesh
from models import NanoGPT
from tp_checks import parity

import slapo_fn as sf


def _nanogpt_chain(rank: int, world: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = NanoGPT()
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    r = parity(model, lambda s: sf.sequence_parallel(s, "transformer.h.*"), (ids,), shape=(world,), tracker=False,
               predict=False)
    return {"on_dtensors": r["on_dtensors"]}


@pytest.mark.timeout(120)
def test_a_chain_over_nanogpts_blocks_runs_its_contiguous_view(dist2) -> None:
    """nanoGPT's attention ends in ``y.transpose(1, 2).contiguous().view(b, t, c)``. On
    DTensor activations the attention's output has the meta kernel's strides on its
    wrapper and the math kernel's on its local tensor, so the wrapper said contiguous
    where the local was not and the view failed inside the model; ``contiguous()`` now
    makes the local contiguous: equal to the single process (parity checks the output
    and every gradient)."""
    assert all(r["on_dtensors"] for r in dist2.run(_nanogpt_chain, timeout=90))


def _wrapper_says_contiguous(rank: int, world: int) -> list[bool]:
    from torch.distributed.tensor import DTensor, Shard

    from slapo_fn.dtensor.region import OnDTensors

    local = torch.randn(2, 3, 4).transpose(1, 2)  # (2, 4, 3), not contiguous
    x = DTensor.from_local(local, mesh((world,), ("tp",)), [Shard(0)], run_check=False, shape=(2 * world, 4, 3),
                           stride=(12, 3, 1))  # a wrapper that says contiguous
    with OnDTensors():
        y = x.contiguous()
        z = y.view(2 * world, 12)
    assert isinstance(y, DTensor) and isinstance(z, DTensor)
    return [x._local_tensor.is_contiguous(), y._local_tensor.is_contiguous(),
            bool(torch.equal(z.to_local(), local.reshape(2, 12)))]


@pytest.mark.timeout(60)
def test_contiguous_makes_the_local_tensor_contiguous_whatever_the_wrapper_says(dist2) -> None:
    assert dist2.run(_wrapper_says_contiguous, timeout=30) == [[False, True, True]] * 2


def _tied_vocab_split(rank: int, world: int) -> dict[str, object]:
    import transformers

    found: dict[str, object] = {}
    for name in ("llama", "t5"):
        torch.manual_seed(0)
        ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(0))
        if name == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, tie_word_embeddings=True, use_cache=False))
            path, inputs = "lm_head", (ids,)
        else:
            model = transformers.T5ForConditionalGeneration(transformers.T5Config(
                vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0,
                decoder_start_token_id=0))
            path, inputs = "shared", (ids, torch.ones_like(ids), ids)
        r = parity(model, lambda s, p=path: sf.shard(s, p, axis=0), inputs, shape=(world,), tracker=False,
                   predict=False, atol=2e-5, loss=lambda o, _: o.logits.float().square().mean())
        found[name] = bool(r["on_dtensors"])
    return found


@pytest.mark.timeout(150)
def test_an_embedding_reading_a_vocabulary_split_through_a_tie_reduces_its_rows_once(dist2) -> None:
    """A LLaMA with tied embeddings whose head alone is split by vocabulary, and T5 with its
    never-called ``shared`` split so: the embedding that runs reads the split weight
    through the tie, and DTensor gives its rows as a masked partial whose mask every value
    made from them shares. A norm that reads them twice (``x.float().pow(2)``, then
    ``x * rsqrt(var)``) found the mask spent: a raw ``AssertionError`` from inside DTensor.
    They are now reduced once, right after the lookup: equal to the single process
    (output and every gradient)."""
    assert dist2.run(_tied_vocab_split, timeout=120) == [{"llama": True, "t5": True}] * 2


def _split_of_what_a_gather_made(rank: int, world: int) -> dict[str, object]:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    from slapo_fn.dtensor.region import Activations, region

    m = mesh((world,), ("tp",))
    acts = Activations(m, ("tp",))
    whole = torch.randn(4, 2 * world, generator=torch.Generator().manual_seed(0))
    found: dict[str, object] = {}
    for name, own in (("made of split values", False), ("beside a whole value of its own", True)):
        local = whole.chunk(world, -1)[rank].clone().requires_grad_()
        a = DTensor.from_local(local, m, [Shard(1)], run_check=False)
        w = DTensor.from_local(torch.full((4, 2 * world), 3.0, requires_grad=True), m, [Replicate()],
                               run_check=False)

        def forward(a: DTensor, w: DTensor = w, own: bool = own) -> DTensor:
            g = acts.moved(a, (Replicate(),))  # gathered: whole because a was split
            y = g * w if own else g * 3.0
            return acts.moved(y, (Shard(1),)).to_local()  # a row's input, split again

        with CommDebugMode() as comm:
            out = region(acts, forward, {})(a)
            fwd = comm.get_total_counts()
            (out * out).sum().backward()
        expected = (2 * 9 * whole).chunk(world, -1)[rank]
        right = local.grad is not None and bool(torch.allclose(local.grad, expected))
        found[name] = (fwd, comm.get_total_counts() - fwd, right)
    return found


@pytest.mark.timeout(60)
def test_a_split_of_a_value_made_whole_of_split_ones_hands_its_gradient_on_split(dist2) -> None:
    """A value gathered in a region and split again for a row (BART's attention output,
    made of its split heads and a value a sync gathered) hands its gradient back split:
    the gather's backward takes it so, and gathering it at the split (``redistribute``'s
    backward) would add an all-gather. Beside a value that is whole for its own sake (a
    replicated operand, whose gradient every later op would gather again), the split
    gathers the gradient once, as before. The gradients are the single process's."""
    found = dist2.run(_split_of_what_a_gather_made, timeout=30)[0]
    assert found == {"made of split values": (1, 0, True), "beside a whole value of its own": (1, 1, True)}
