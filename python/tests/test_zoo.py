"""The zoo: Collider on a tiny random model of every transformers causal-LM, masked-LM, image-text-to-text,
sequence-to-sequence and speech-sequence-to-sequence architecture.

One test per model class of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and
MODEL_FOR_MASKED_LM_MAPPING_NAMES, of MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES run with images, and of
MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES and MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES run twice, the
encoder's source as long as the target and of another length (zoo.architectures(); the id is the mapping
key, with "-masked", "-image", "-seq2seq-same" and so on for those tasks); and each again with batch,
sequence and hidden sizes equal (test_equal_sizes, zoo.run_equal):
zoo.run_architecture builds it tiny, traces a plan, and compares filter_backward's parameter
gradients with mask_backward's (the oracle) for eager and sdpa attention, per_sequence keep masks
at filter_ratio 0.25 and 0.5 and a ragged batch_topk one, both semantics (zoo.py's docstring). The
test fails when an architecture is `wrong` (accepted, gradients differ beyond 1e-4 in float64,
1e-3 in float32, relative to each parameter's largest entry or to 1e-5 of the largest of all; or refused, but a plain backward of that loss no longer gives the loss_only
gradient) or `crashed` (an exception other than collider.Error after Collider accepted, or an
untyped error from Collider); `refused` and `not buildable` pass. Marker `zoo` (conftest.py): left
out of ./scripts/test.sh --quick. 684 s for both runs of 444 architectures on 2 cores, one thread each
(zoo_table.py --jobs 2; docs/ZOO.md's date). The table of outcomes: python/tests/zoo_table.py writes docs/ZOO.md.
  pytest -m zoo python/tests/test_zoo.py
"""
import pytest

import zoo

ARCHITECTURES = zoo.architectures()


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=[a.id for a in ARCHITECTURES])
def test_architecture(arch):
    check(zoo.run_architecture(arch))


EQUAL_ARCHITECTURES = [a for a in ARCHITECTURES if a.source != "other"]


@pytest.mark.parametrize("arch", EQUAL_ARCHITECTURES, ids=[a.id for a in EQUAL_ARCHITECTURES])
def test_equal_sizes(arch):
    """The coincidence test: batch, sequence and hidden sizes equal (zoo.run_equal), an encoder-decoder's source
    as long as its target: a result that depends on two sizes differing fails here."""
    check(zoo.run_equal(arch))


def check(result):
    arch = result.arch
    detail = "; ".join(f"{attn}: {r.outcome} ({r.cause})" if r.cause else f"{attn}: {r.outcome}"
                       for attn, r in result.impls.items())
    print(f"{arch.name} {arch.model_class}: {result.outcome} in {result.seconds:.1f} s; {detail}")
    assert result.outcome not in ("wrong", "crashed"), f"{arch.model_class}: {detail}"
