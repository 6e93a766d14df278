"""Round 27c (2026-12-07/08, one H100 80GB): round 23's fine-tune over 96 steps with full checkpointing, which chapter
10 reads through labs.course.zenflow_long. Each test checks the readings against the files and the READMEs' figures
against the readings."""
import json

from conftest import ROOT, unquoted
from labs import CONFIGS
from labs.course import zenflow_long as long


def test_every_run_is_round_23s_setup_with_recompute_and_starts_from_the_same_weights():
    """Like for like: the same configs, tokens per step and batches as round 23, checkpointing the only change (and
    the card); the runs start from one set of weights, and the first steps repeat round 23's."""
    configs = {long.REFERENCE: "labs_zero2.json", long.PLAIN: "labs_zero2_offload.json",
               long.ZENFLOW: "labs_zero2_offload_zenflow_sequential.json"}
    firsts = set()
    for name, config in configs.items():
        summary = json.loads((long.ROUND27C / name / "summary.json").read_text())
        assert summary["tokens_per_step"] == 32768 and summary["activation_checkpointing"] == "full"
        assert summary["device"] == "NVIDIA H100 80GB HBM3" and summary["model_path"] == "/tmp/pre_hf"
        committed = json.loads((CONFIGS / "bench" / config).read_text())["zero_optimization"]
        ran = json.loads((long.ROUND27C / name / "ds_config.json").read_text())["zero_optimization"]
        assert ran.get("zenflow") == committed.get("zenflow") and ran.get("offload_optimizer") == committed.get(
            "offload_optimizer")
        firsts.add(round(json.loads((long.ROUND27C / name / "metrics.jsonl").read_text().splitlines()[0])["loss"], 6))
    assert len(firsts) == 1
    repeats = long.repeat_gaps()
    assert repeats["pre-training"] < 0.05 and max(repeats[k] for k in ("no offload", "ZenFlow", "plain offload")) < 0.02
    assert repeats["plain offload against no offload"] < 0.005          # the stand-in for plain offload after step 24


def test_the_gap_grows_and_plain_offload_stays_ahead_at_equal_time():
    """The round's two answers, from the files: the gap widens in every window, and plain offload's loss in ZenFlow's
    time is lower, with ZenFlow's speed advantage short of what a tie needs."""
    found = [g["gap"] for g in long.gaps()]
    assert [g["steps"] for g in long.gaps()] == ["41-48", "49-56", "57-64", "65-72", "73-80", "81-88", "89-96"]
    assert all(a < b for a, b in zip(found, found[1:])) and found[0] > 0.5
    e = long.equal_time()
    assert e["plain_loss"] < e["zen_loss"] and e["had"] < e["tie"]
    runs = long.runs()
    assert runs[long.PLAIN]["share"] < runs[long.ZENFLOW]["share"] < 1 == runs[long.REFERENCE]["share"]


def test_the_readmes_state_what_chapter_10_prints():
    runs, gaps, e = long.runs(), long.gaps(), long.equal_time()
    shares = [f"{runs[n]['share']:.1%}" for n in (long.PLAIN, long.ZENFLOW)]
    folder = [f"+{g['gap']:.2f}" for g in gaps[::2]] + shares + [f"{e['plain_steps']:.1f}",
              f"{e['zen_loss'] - e['plain_loss']:.2f} nats below", f"steps {e['plain_window']}", f"worth {e['worth']}", f"{e['tie']:.2f}x",
              f"{e['had']:.2f}x"]
    assert unquoted(long.ROUND27C.parent / "README.md", folder) == []
    main = [f"+{gaps[0]['gap']:.3f} nats over steps 41-48", f"+{gaps[-1]['gap']:.3f} over steps 89-96", *shares,
            f"at its step {int(e['plain_steps'])}, {e['zen_loss'] - e['plain_loss']:.2f} nats lower"]
    assert unquoted(ROOT / "README.md", main) == []
    assert unquoted(ROOT / "results" / "README.md", [f"+{gaps[0]['gap']:.2f} nats", f"+{gaps[-1]['gap']:.2f} over"]) == []
