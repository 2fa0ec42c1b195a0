"""apply_sinks: the sinks stage as a library call, with its report."""

import torch
from tiny_models import ARCHS, VOCAB, tiny_model

import pytest

from hf_csa2.model import SINK_OFF
from hf_csa2.surgery.plan import SinksPlan
from hf_csa2.surgery.sinks import apply_sinks


def windows(n=4, length=24, seed=0):
    return torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def sink_values(model) -> torch.Tensor:
    return torch.cat([layer.self_attn.sinks.detach().flatten() for layer in model.model.layers])


@pytest.mark.parametrize("arch", ARCHS)
def test_calibrated_sinks_report_the_values_they_set_and_keep_the_outputs(arch):
    src = tiny_model(arch)
    model, report = apply_sinks(src, SinksPlan(margin=24.0), windows=windows())
    values = sink_values(model)
    assert report.sink_min == pytest.approx(values.min().item()) and report.sink_max == pytest.approx(values.max().item())
    assert report.sink_max > SINK_OFF  # calibrated: just below the logsumexps, not switched off
    assert report.stage_notes() == {"init": "calibrated", "sink_min": report.sink_min, "sink_max": report.sink_max,
                                    "margin": 24.0}
    x = windows(2, 20, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, src(x).logits, atol=1e-5, rtol=1e-5)


def test_sinks_off_stay_off_and_a_calibrated_plan_needs_windows():
    model, report = apply_sinks(tiny_model("llama"), SinksPlan(init="off"))
    assert torch.all(sink_values(model) == SINK_OFF)
    assert report.sink_min is None and report.stage_notes() == {"init": "off"}
    with pytest.raises(ValueError, match="needs calibration windows"):
        apply_sinks(tiny_model("llama"), SinksPlan())
