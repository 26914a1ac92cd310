"""The Job facade reads its plain attributes from its parts (planaria.control.facade)."""

from __future__ import annotations

from planaria.control.facade import Delegated


class Part:
    def __init__(self) -> None:
        self.count = 3


class Facade:
    count = Delegated[int]("part")

    def __init__(self) -> None:
        self.part = Part()


def test_an_attribute_is_read_from_the_part_each_time():
    facade = Facade()
    assert facade.count == 3
    facade.part.count = 4
    assert facade.count == 4
    assert isinstance(Facade.count, Delegated)  # on the class: the descriptor itself


def test_the_job_delegates_what_its_users_read():
    from planaria.control.job import Job

    delegated = {name for name, value in vars(Job).items() if isinstance(value, Delegated)}
    assert delegated == {"members", "gen", "width", "names", "plan", "ledger", "losses",
                         "skipped_samples"}
