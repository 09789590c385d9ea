import hashlib

from agent_r1.data import split_of


def test_buckets_are_fixed_and_sized_ten_ten_eighty():
    questions = [f"question number {i}?" for i in range(5000)]
    splits = [split_of(q) for q in questions]
    assert splits == [split_of(q) for q in questions]  # a function of the text alone
    for name, share in (("test", 0.1), ("val", 0.1), ("train", 0.8)):
        assert abs(splits.count(name) / len(splits) - share) < 0.015, name
    # the held-out split is the same 10% bucket it was before validation existed
    held_out = [int(hashlib.sha256(q.encode()).hexdigest(), 16) % 10 == 0 for q in questions]
    assert held_out == [s == "test" for s in splits]
