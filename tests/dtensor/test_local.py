"""``tp_local``: a statement the plan keeps only where the data flow shows it."""

from __future__ import annotations

import pytest
import torch
from models import VOCAB, tiny_bert
from tp_checks import parity

import slapo_fn as sf
from slapo_fn.dtensor.testing import fake_mesh


def test_tp_local_inside_untraceable_code_is_unproven_not_trusted() -> None:
    """BERT's embeddings LayerNorm runs inside ``BertEmbeddings``, whose code fx cannot
    trace: nothing shows that only this rank's shard reaches it (the whole sum of the
    embeddings does), so the plan does not sum its gradients over the ranks on the
    statement's word; it runs the model on DTensor activations, naming why."""
    sch = sf.tp_local(sf.create_schedule(tiny_bert(), mesh=fake_mesh(2)), "embeddings.LayerNorm")
    why = sf.dtensor.plan(sch).on_dtensors
    assert any(p.path == "embeddings.LayerNorm" and "caller's code cannot be traced" in p.reason for p in why), why


def _bert_local(rank: int, world: int) -> list[bool]:
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    r = parity(tiny_bert(), lambda s: sf.tp_local(s, "embeddings.LayerNorm"), (ids,), shape=(world,), tracker=False,
               predict=False, loss=lambda out, _: out.last_hidden_state.float().pow(2).mean())
    return [r["on_dtensors"]]


@pytest.mark.timeout(120)
def test_tp_local_where_the_whole_input_arrives_keeps_the_gradients(dist2) -> None:
    """Its gradients were summed over the ranks: twice the single process's, silently.
    Now equal (parity compares the output and every gradient)."""
    assert dist2.run(_bert_local, timeout=90) == [[True], [True]]


def _transformer() -> torch.nn.Module:
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(0)
    return Transformer(ModelArgs(n_layers=2, vocab_size=VOCAB, max_seq_len=8, dim=32, n_heads=4, dropout_p=0.0))


def _token_split_then_local(sch: sf.Schedule) -> sf.Schedule:
    """PyTorch's test Transformer: layer 0's MLP as a column and a row, a token split stated
    on the column's output (the MLP then runs on DTensors and hands its result on whole),
    and ``tp_local`` on layer 1's attention norm, which that whole result reaches."""
    from torch.distributed.tensor import Shard

    sch = sf.shard(sf.shard(sch, "layers.0.feed_forward.w1", axis=0), "layers.0.feed_forward.w2", axis=1)
    sch = sf.sync(sch, "layers.0.feed_forward.w1", "fwd_post", Shard(1))
    return sf.tp_local(sch, "layers.1.attention_norm")


def test_tp_local_past_a_layout_the_flow_cannot_tell_is_unproven_not_trusted() -> None:
    """The token split leaves the flow unable to tell what reaches the norm: the statement
    is not believed (its gradients were summed over the ranks, ×2 at tp=2, ×4 at tp=4)."""
    why = sf.dtensor.plan(_token_split_then_local(sf.create_schedule(_transformer(), mesh=fake_mesh(2)))).on_dtensors
    assert any(p.path == "layers.1.attention_norm" and "cannot tell what reaches it" in p.reason for p in why), why


def _transformer_local(rank: int, world: int) -> list[bool]:
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    r = parity(_transformer(), _token_split_then_local, (ids,), shape=(world,), tracker=False, predict=False,
               loss=lambda out, _: out.float().pow(2).mean())
    return [r["on_dtensors"]]


@pytest.mark.timeout(120)
def test_tp_local_past_a_token_split_keeps_the_gradients(dist2) -> None:
    assert dist2.run(_transformer_local, timeout=90) == [[True], [True]]
