"""Exact recurrent state on the real CPU engine with Mamba2: a tiny NemotronH (Mamba2 +
attention, fp32, align mode). Only for releases whose CPU engine runs Mamba2 (the noxfile
selects `-m mamba2` where releases.toml lets the release run the smoke's nemotronh case).

Runs in its own pytest process (`-m mamba2`): one CPU engine per process.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.mamba2


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory):
    from kvwarm_testing.engine import Engine, fp32_conv_refusal, skip_where_refused
    from kvwarm_testing.tiny_models import make_tiny_nemotron_h
    from vllm import LLM

    skip_where_refused(fp32_conv_refusal())

    model = make_tiny_nemotron_h(tmp_path_factory.mktemp("tiny-nemotron-h"))
    return Engine(
        LLM(
            model=str(model),
            dtype="float32",
            mamba_cache_mode="align",
            seed=0,
            enforce_eager=True,
            max_model_len=2048,
            max_num_batched_tokens=256,
            max_num_seqs=8,
            enable_prefix_caching=True,
            scheduler_cls="vllm.kvwarm.scheduler.KvWarmScheduler",
        )
    )


def test_exact_state_shadows_decode_like_natural_requests_off_the_boundaries(nemotron_h, capsys):
    from kvwarm_testing.exact_fidelity import check_exact_state, print_report

    print_report(check_exact_state(nemotron_h, "nemotron-h", vocab=400), capsys)
