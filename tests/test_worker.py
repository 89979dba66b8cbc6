"""One rank of a slapo-fn job (slapo_fn.worker), in this process: what it keeps quiet."""

from __future__ import annotations

import logging
import warnings

import pytest

from slapo_fn import worker


def test_the_warnings_known_to_be_harmless_are_kept_out_and_no_others(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    before = list(logger.filters)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            worker._quiet_harmless()
            warnings.warn("FSDP2-wrapped module (FSDPLlamaForCausalLM) returned a view tensor. An in-place op ...",
                          UserWarning, stacklevel=1)
            warnings.warn("FSDP2 will do something else", UserWarning, stacklevel=1)
        assert [str(w.message) for w in caught] == ["FSDP2 will do something else"]
        with caplog.at_level(logging.WARNING, logger=logger.name):
            logger.warning("While redistributing from (_StridedShard(dim=0, sf=2), Shard(dim=0)) to ...")
            logger.warning("While redistributing from (Shard(dim=0), Shard(dim=1)) to ...")
        assert [r.getMessage() for r in caplog.records] == ["While redistributing from (Shard(dim=0), Shard(dim=1)) "
                                                            "to ..."]
    finally:
        logger.filters[:] = before
