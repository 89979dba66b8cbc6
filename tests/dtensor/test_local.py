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
