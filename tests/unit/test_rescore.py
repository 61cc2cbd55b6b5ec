"""Re-scoring: a stored dataset's logs collected again under another rule, as a new dataset version whose counts
reconcile with its source's, without moving the watermark; and the refusals when that cannot be done exactly."""

from __future__ import annotations

import pytest

from data_contracts import dataset
from data_contracts.collect_settings import CollectSettings
from data_contracts.rescore import RescoreError
from data_contracts.reward_rules import RuleError
from data_contracts.rewards import RewardRule
from tests.collect_harness import collect_once, rescore_once
from tests.unit.test_contracts_data import T0, FixedVersions, completion, feedback, put_logs
from tidal.model_settings import FeedbackPolicy
from tidal.store import LocalStore

POLICY = FeedbackPolicy(events=["accepted", "rejected", "partial", "thumbs"])
TAB = RewardRule()


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """A store with one hour of logs collected under the Tab rule: an accepted, a rejected, a thumbs-up-only and a
    silent completion, and one of an unknown version (quarantined). Shared by the module's tests, in order: the
    last one removes a log object."""
    store = LocalStore(tmp_path_factory.mktemp("rescore") / "store")
    cs = [completion(T0 + 600_000 + i * 1000, i, text="x" * 20) for i in range(4)]
    unknown = completion(T0 + 700_000, 5, version=9)
    put_logs(store, "completions", [*cs, unknown])
    put_logs(store, "feedback", [feedback(cs[0]), feedback(cs[1], "rejected"), feedback(cs[2], "thumbs", thumbs="up")])
    first = collect_once(store, FixedVersions([1], 1), "tab", CollectSettings(), T0 + 7_200_000, feedback=POLICY)
    return store, first


def test_a_dataset_rescored_under_another_rule_reconciles_with_its_source(collected) -> None:
    store, first = collected
    late = completion(T0 + 800_000, 6)  # stored after the source was collected: not the source's, not the re-score's
    put_logs(store, "completions", [late])
    again = rescore_once(store, "tab", first.dataset_id, "feedback-blend@1", TAB, POLICY)
    src, new = first.manifest, again.manifest
    assert again.dataset_id != first.dataset_id and new.reward_rule.id == "feedback-blend@1"
    assert (new.rescored_from, new.rescored_from_rule.id) == (first.dataset_id, "cursor-tab@1")
    assert dataset.read_watermark(store, "tab").dataset_id == first.dataset_id  # the watermark did not move
    assert new.watermark_after == src.watermark_after and new.quarantine == src.quarantine
    for kind in ("completions", "feedback"):
        a, b = getattr(src.counts, kind), getattr(new.counts, kind)
        assert (b.in_, b.quarantined, b.quarantined_by_reason) == (a.in_, a.quarantined, a.quarantined_by_reason)
        assert b.in_ == b.kept + b.quarantined + b.filtered
    # the only difference the rule makes: the thumbs-only row is feedback to the blend rule, none to Tab's
    assert src.counts.completions.filtered_by_reason.get("no_feedback") == 2
    assert new.counts.completions.filtered_by_reason.get("no_feedback") == 1
    assert new.counts.completions.kept == src.counts.completions.kept + 1
    assert sorted(first.samples["reward"].to_pylist()) == pytest.approx([-0.25, 0.75])
    assert sorted(again.samples["reward"].to_pylist()) == pytest.approx([-1.0, 1.0, 1.0])
    stored = dataset.read_manifest(store, "tab", again.dataset_id)
    assert stored.rescored_from == first.dataset_id and stored.digest == new.digest


def test_a_rule_is_named_by_id_or_given_as_json(collected) -> None:
    store, first = collected
    weighted = rescore_once(store, "tab", first.dataset_id, '{"plugin": "feedback-blend", "version": 2}', TAB, POLICY)
    assert weighted.manifest.reward_rule.id == "feedback-blend@2"
    with pytest.raises(RuleError, match=r"no rule with that id; the model's rule is cursor-tab@1, .*'feedback-blend@1'"):
        rescore_once(store, "tab", first.dataset_id, "nope@3", TAB, POLICY)
    with pytest.raises(RuleError, match="not valid JSON"):
        rescore_once(store, "tab", first.dataset_id, "{plugin", TAB, POLICY)


def test_a_rescore_that_cannot_reproduce_its_source_is_refused(collected) -> None:
    store, first = collected
    with pytest.raises(RescoreError, match="already under cursor-tab@1"):
        rescore_once(store, "tab", first.dataset_id, "cursor-tab@1", TAB, POLICY)
    with pytest.raises(RescoreError, match=r"re-scored under feedback-blend@1 already \(dataset .*\): a rule with other"):
        rescore_once(store, "tab", first.dataset_id, '{"plugin": "feedback-blend", "judge_weight": 1}', TAB, POLICY)
    gone = first.manifest.source_files[0]
    (store.root / gone).unlink()  # lost from the store
    with pytest.raises(RescoreError, match=f"1 of its .* log objects are gone from the store \\(first: {gone}\\)"):
        rescore_once(store, "tab", first.dataset_id, "feedback-blend@1", TAB, POLICY)


def test_lineage_names_the_source_of_a_rescored_dataset() -> None:
    from data_contracts.manifest import RuleRef
    from tidal import lineage

    assert lineage.rescore_tags(None, None) == {}
    tags = lineage.rescore_tags("tab-abc", RuleRef(id="cursor-tab@1"))
    assert tags == {"tidal.rescored_from": "tab-abc", "tidal.rescored_from.rule": "cursor-tab@1"}
