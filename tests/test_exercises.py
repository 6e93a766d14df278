import pytest

from labs.course import exercises


@pytest.mark.parametrize("id, right, wrong", [
    ("00.1", 11.93, 10.0),                          # ln of tiny's vocabulary, not log2 or a guess
    ("00.2", 4 * 4 * 8 * 64, 4 * 8 * 64),           # every rank's micro-batches, not one rank's
    ("00.3", 3584**2, 64**2),                       # Qwen2.5-7B's hidden squared, not tiny's
    ("02.1", 3 * 4 * 9_822_784 / 4 / 2**20, 2 * 4 * 9_822_784 / 4 / 2**20),   # the fp32 master copy counts
    ("02.2", 3584**2 * 2 / 2**20, 2 * 3584**2 * 2 / 2**20),    # ZeRO-3 keeps one bucket, not two
    ("02.3", 3 * 7_615_616_512 * 2 * 7 / 8 / 1e9, 3 * 7_615_616_512 * 2 / 1e9),   # a ring sends (N-1)/N
    ("02.4", 28 * (2 * 3584 + 3584 + 2 * 512) + 3584, 28 * 2 * 3584 + 3584),  # the q/k/v biases stay whole too
    # per rank: fp32 master and gradient 3.5 -> 4 GiB each, bf16 buffer 1.8 -> 2, staging (the embedding) 1.0 -> 2,
    # pinned at powers of two; Adam's 8 bytes per parameter are not pinned. Without the rounding: 18 bytes + staging
    ("03.1", 8 * (12 + 8 * 7_615_616_512 / 8 / 2**30), (18 * 7_615_616_512 + 8 * 2 * 152_064 * 3584) / 2**30),
    ("03.2", 4 * 8192 / (4 * (0.2344 + 1.3670) + 4.6018), 8192 / 6.189),
    ("03.3", "optimizer+params", "optimizer"),      # at 8192 with the 'hf' loss the optimizer alone is 8 GiB over
    ("01.1", 4 + 16 / 16, 2 + 18 / 16),              # ZeRO-1 keeps the bf16 gradients whole: not ZeRO-2's rule
    ("01.1", 4 + 16 / 16, 4 + 12 / 16),              # DeepSpeed's rules count the fp32 gradient copy, the paper not
    ("01.2", "optimizer_step", "loss_backward"),    # with activations small, the fp32 copy of the update decides
    ("01.5", 18 * 7_615_616_512 / 1e9, 12 * 7_615_616_512 / 1e9),   # fp32 grads and ZeRO-3's bf16 ones go too
    ("01.4", 21.0, 2 * 2 * 7_615_616_512 / 2**30),  # the start-up flatten goes to the CPU on a card without room
    ("06.1", 19 // 8, 19 // 8 + 1),                 # nodes count from 0, as node ranks do
    ("08.1", 2**20 // 4096 // (16 * 4), 2**20 // 4096 // (8 * 4)),   # the ranks of both nodes, not one node's
    # iterations 101-248: after the peak at 100, before the floor at 250 - 1; accelerate divides the total (1000 / 4)
    ("08.2", 248 - 101 + 1, 998 - 101 + 1),
    ("08.2", 248 - 101 + 1, 248 - 26 + 1),          # ... and passes the warm-up as it is, not divided
    ("08.3", 1, 2),                                 # the first step's 0 is DeepSpeed's, not the warm-up's
    ("08.4", 2 ** -7, 2 ** -6),                     # half a bf16 step near 2.7, not a whole one
    ("05.1", 0.766, 0.383),                          # 28 layers x 2 x 3584 bytes x 4096 tokens, not one byte each
    # ZeRO-2: 14 bytes in the checkpoint and 14 in its universal copy, not ZeRO-3's 12 and 12 x (1 + 1/8)
    ("05.2", (14 + 14) * 7_615_616_512 / 1e9, (12 + 12 * (1 + 1 / 8)) * 7_615_616_512 / 1e9),
    ("05.2", (14 + 14) * 7_615_616_512 / 1e9, (14 + 12 * (1 + 1 / 8)) * 7_615_616_512 / 1e9),   # ZeRO-3's copy rule
    ("05.3", 700 + 400 + 100, 1000 + 100),           # the last step's save is the one cut: the resume starts at 900
    ("05.4", 23.0, 24.9),                            # Qwen2.5-7B (GQA, 28 layers), not Qwen-7B's 24.9
    ("09.7", (74.1 + 98.4) / 2, 98.4 * 3 / 4),     # one more sequence's activations, not 3/4 of the whole peak
    ("09.8", 2 * 7_615_616_512 / 4 / 2**30, 2 * 7_615_616_512 / 2**30),   # a quarter of the model, not all of it
    ("10.1", 8 * 7_615_616_512 / 2**30, 16 * 7_615_616_512 / 2**30),   # labs keeps one set of moments, not two
    ("10.3", 0.1 / (1 - 0.9**8) / (0.05 / (1 - 0.95**8)) ** 0.5, 0.56),   # step 8's factors, not interval 4's first move
    ("10.2", 4 * 7_615_616_512 / 46.5e9, 2 * 7_615_616_512 / 46.5e9),   # fp32 crosses, cast on the GPU after
    # the 8 x 1 native row (128.7 GiB) plus each bf16 gradient waiting on the host, not an fp32 one
    ("10.4", 128.68 + 2 * 7_615_616_512 / 2**30, 128.68 + 4 * 7_615_616_512 / 2**30),
    # round 29's cast copy less the uncast one from page-locked memory, over the 5.44 B offloaded (whole sub-groups at
    # the 70% setting): not the whole cast copy
    ("10.5", (0.37528 - 0.07328) * 5_439_221_760 / 1e9, 0.37547 * 5_439_221_760 / 1e9),
    ("10.6", 4, 5),                                 # int(0.35 x 14) keeps 4, not round()'s 5
])
def test_checkers_accept_the_answer_and_reject_others(id, right, wrong, capsys):
    unanswered = (exercises.check(id, None), capsys.readouterr().out)
    assert unanswered[0] is False and "not answered yet" in unanswered[1] and "Hint" not in unanswered[1]
    assert exercises.check(id, right) is True and capsys.readouterr().out.startswith(f"{id} correct")
    assert exercises.check(id, wrong) is False and capsys.readouterr().out.startswith(f"{id} not yet")


def test_a_text_answer_to_a_number_question(capsys):
    assert exercises.check("02.1", "lots") is False and "not a number" in capsys.readouterr().out


def test_unknown_exercise_is_a_labs_error():
    from labs.errors import LabsError

    with pytest.raises(LabsError, match="unknown exercise '99.9'"):
        exercises.check("99.9", 1)


def test_no_expected_answer_is_a_literal():
    """Every registered answer is computed: its function calls into labs and never returns a constant."""
    import ast
    import inspect
    import textwrap

    for ex in exercises.EXERCISES.values():
        tree = ast.parse(textwrap.dedent(inspect.getsource(ex.expected)))
        returns = [n.value for n in ast.walk(tree) if isinstance(n, ast.Return)]
        assert returns and not any(isinstance(r, ast.Constant) for r in returns), ex.id
        assert any(isinstance(n, ast.Call) for n in ast.walk(tree)), ex.id
