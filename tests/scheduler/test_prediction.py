"""The prediction proposer's alignment (`scheduler/prediction.py`) and the drafter's use of it:
drafts follow the prediction while the output keeps to it, find their place again after an
edit (a changed, deleted or inserted run), start over after a preemption, and accepted drafts
from a prediction are counted on the request."""

from __future__ import annotations

from deepinfer.outputs import RunnerOutput, SampledToken
from deepinfer.request import Request, SamplingParams
from deepinfer.scheduler.cost_model import StepCostModel
from deepinfer.scheduler.draft_gate import DraftGate
from deepinfer.scheduler.drafting import Drafter
from deepinfer.scheduler.prediction import MAX_MATCH, PREDICTION_DRAFT_TOKENS, PredictionProposer
from deepinfer.scheduler.speculative import NgramProposer

PRED = list(range(100, 160))


def _request(outputs: list[int], prediction: list[int] = PRED, rid: str = "r") -> Request:
    r = Request(
        request_id=rid,
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=500, temperature=0.0),
        predicted_token_ids=tuple(prediction),
    )
    r.output_token_ids.extend(outputs)
    return r


def test_drafts_follow_the_prediction_while_the_output_keeps_to_it() -> None:
    p = PredictionProposer()
    r = _request([100])
    assert p.propose(r, 4).token_ids == (101, 102, 103, 104)
    r.output_token_ids.extend([101, 102])  # two of them accepted, then the model's own 103
    r.output_token_ids.append(103)
    draft = p.propose(r, 3)
    assert draft.token_ids == (104, 105, 106) and draft.signals == (1.0,)
    assert p.propose(_request([100], rid="other"), 0).size == 0


def test_a_changed_token_is_left_behind_once_the_output_is_back_on_the_text() -> None:
    p = PredictionProposer()
    r = _request([100, 101, 102])
    assert p.propose(r, 2).token_ids == (103, 104)
    r.output_token_ids.append(999)  # the edit: 103 becomes 999
    assert p.propose(r, 2).size == 0  # lost: one token is no place
    r.output_token_ids.append(104)  # [999, 104]: not in the prediction either
    assert p.propose(r, 2).size == 0
    r.output_token_ids.append(105)  # [104, 105] is
    draft = p.propose(r, 3)
    assert draft.token_ids == (106, 107, 108) and draft.signals == (2 / MAX_MATCH,)
    r.output_token_ids.append(106)
    assert p.propose(r, 2).token_ids == (107, 108)  # in step again


def test_a_deleted_run_is_skipped_forward_and_an_insertion_waited_out() -> None:
    p = PredictionProposer()
    r = _request([100, 101, 102])
    p.propose(r, 2)
    r.output_token_ids.extend([130, 131])  # 103..129 deleted
    assert p.propose(r, 2).token_ids == (132, 133)
    r.output_token_ids.extend([7, 8, 9])  # inserted lines
    assert p.propose(r, 2).size == 0
    r.output_token_ids.extend([132, 133, 134])
    assert p.propose(r, 2).token_ids == (135, 136)


def test_realignment_prefers_the_place_after_the_edit_over_an_earlier_repeat() -> None:
    line = [7, 8, 9]
    pred = [*line, 50, 51, *line, 60, 61, 62]
    p = PredictionProposer()
    r = _request([7, 8, 9, 50, 51], prediction=pred)
    p.propose(r, 2)
    r.output_token_ids.extend([55, *line])  # an inserted token, then the repeated line
    assert p.propose(r, 3).token_ids == (60, 61, 62)


def test_a_preempted_request_starts_over_and_forget_drops_it() -> None:
    p = PredictionProposer()
    r = _request([100, 101, 102, 103])
    p.propose(r, 2)
    r.output_token_ids[:] = [100]  # recomputed from its prompt after preemption
    assert p.propose(r, 2).token_ids == (101, 102)
    p.forget("r")
    assert p.propose(_request([5]), 2).size == 0
    assert p.propose(_request([100], prediction=[]), 2).size == 0


def test_the_drafter_drafts_predictions_without_a_proposer_and_counts_their_acceptance() -> None:
    drafter = Drafter(None, DraftGate(StepCostModel(), 1, enabled=False), 5)
    plain, predicted = _request([1], prediction=[], rid="a"), _request([100], rid="b")
    assert drafter.plan([plain], 1000) == {}  # no prediction anywhere: nothing asked
    drafts = drafter.plan([plain, predicted], 1000)
    assert set(drafts) == {"b"} and drafts["b"].token_ids[:3] == (101, 102, 103)
    assert len(drafts["b"].token_ids) == PREDICTION_DRAFT_TOKENS  # beyond num_draft_tokens
    out = RunnerOutput(
        step=1,
        sampled={"b": SampledToken(101)},
        accepted={"b": (SampledToken(102), SampledToken(103))},
    )
    drafter.observe_request(predicted, 16, out)
    assert predicted.num_accepted_prediction_tokens == 2
    assert drafter.counts().proposer == "prediction" and drafter.counts().num_accepted == 2


def test_with_a_proposer_a_request_off_its_prediction_drafts_from_it() -> None:
    drafter = Drafter(NgramProposer(), DraftGate(StepCostModel(), 1, enabled=False), 3)
    r = _request([100, 9, 4, 5, 9, 4], prediction=PRED)  # left the prediction; 9 4 repeats
    drafts = drafter.plan([r], 1000)
    assert drafts["r"].token_ids == (5, 9, 4)
    drafter.observe_request(r, 3, RunnerOutput(step=1, sampled={"r": SampledToken(5)}))
    assert r.num_accepted_prediction_tokens == 0
