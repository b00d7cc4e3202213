"""The zoo: Collider on a tiny random model of every transformers causal-LM, masked-LM and image-text-to-text
architecture.

One test per model class of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and
MODEL_FOR_MASKED_LM_MAPPING_NAMES, and of MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES run with images
(zoo.architectures(); the id is the mapping key, with "-masked" or "-image" for those tasks):
zoo.run_architecture builds it tiny, traces a plan, and compares filter_backward's parameter
gradients with mask_backward's (the oracle) for eager and sdpa attention, per_sequence keep masks
at filter_ratio 0.25 and 0.5 and a ragged batch_topk one, both semantics (zoo.py's docstring). The
test fails when an architecture is `wrong` (accepted, gradients differ beyond 1e-4 in float64,
1e-3 in float32, relative to each parameter's largest entry or to 1e-6 of the largest of all; or refused, but a plain backward of that loss no longer gives the loss_only
gradient) or `crashed` (an exception other than collider.Error after Collider accepted, or an
untyped error from Collider); `refused` and `not buildable` pass. Marker `zoo` (conftest.py): left
out of ./scripts/test.sh --quick. About 2 minutes on one CPU thread (2-core machine, 325
architectures). The table of outcomes: python/tests/zoo_table.py writes docs/ZOO.md.
  pytest -m zoo python/tests/test_zoo.py
"""
import pytest

import zoo

ARCHITECTURES = zoo.architectures()


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=[a.id for a in ARCHITECTURES])
def test_architecture(arch):
    result = zoo.run_architecture(arch)
    detail = "; ".join(f"{attn}: {r.outcome} ({r.cause})" if r.cause else f"{attn}: {r.outcome}"
                       for attn, r in result.impls.items())
    print(f"{arch.name} {arch.model_class}: {result.outcome} in {result.seconds:.1f} s; {detail}")
    assert result.outcome not in ("wrong", "crashed"), f"{arch.model_class}: {detail}"
