import pytest

from labs import exercises_zero as ex


@pytest.mark.parametrize("check, right, wrong", [
    (ex.check_02_zero3_volume, 3 * 7_615_616_512 * 2, 2 * 7_615_616_512 * 2),
    (ex.check_02_bucket_bytes, 2_000_000_000, 1_000_000_000),
    (ex.check_02_paper_reduction_key, "use_multi_rank_bucket_allreduce", "overlap_comm"),
    (ex.check_03_host_bytes_per_param, 16, 12),
    (ex.check_03_omp_threads, 8, 1),
    (ex.check_03_single_4090, "optimizer", "none"),
])
def test_checkers_accept_the_answer_and_reject_others(check, right, wrong, capsys):
    assert check(None) is False and "not answered yet" in capsys.readouterr().out
    assert check(right) is True and capsys.readouterr().out.startswith("correct")
    assert check(wrong) is False and capsys.readouterr().out.startswith("not quite")


def test_a_text_answer_to_a_number_question():
    assert ex.check_02_bucket_bytes("lots") is False
