import pytest

from labs import exercises


@pytest.mark.parametrize("id, right, wrong", [
    ("02.1", 3 * 7_615_616_512 * 2, 2 * 7_615_616_512 * 2),
    ("02.2", 2_000_000_000, 1_000_000_000),
    ("02.3", "use_multi_rank_bucket_allreduce", "overlap_comm"),
    ("03.1", 16, 12),
    ("03.2", 8, 1),
    ("03.3", "optimizer", "none"),
])
def test_checkers_accept_the_answer_and_reject_others(id, right, wrong, capsys):
    assert exercises.check(id, None) is False and "not answered yet" in capsys.readouterr().out
    assert exercises.check(id, right) is True and capsys.readouterr().out.startswith(f"{id} correct")
    assert exercises.check(id, wrong) is False and capsys.readouterr().out.startswith(f"{id} not yet")


def test_a_text_answer_to_a_number_question(capsys):
    assert exercises.check("02.2", "lots") is False and "not a number" in capsys.readouterr().out
