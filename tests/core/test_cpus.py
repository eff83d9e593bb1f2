"""CPU lists (`core.cpus`): parsed and printed both ways, bad lists refused naming the part,
and a host's CPUs split among its instances without overlap while there are enough."""

from __future__ import annotations

import pytest

from yuebing.core.cpus import format_cpus, parse_cpus, require_usable, split_cpus, usable_cpus
from yuebing.core.errors import ConfigError


def test_lists_parse_and_print_as_ranges():
    assert parse_cpus("1") == (1,)
    assert parse_cpus("0-3") == (0, 1, 2, 3)
    assert parse_cpus(" 5, 0-2 ") == (0, 1, 2, 5)
    assert format_cpus((5, 0, 1, 2)) == "0-2,5"
    assert format_cpus((3,)) == "3"
    for text in ("0", "0-1", "0,2-4,7"):
        assert format_cpus(parse_cpus(text)) == text


@pytest.mark.parametrize(("text", "why"), [
    ("", "--cpus: empty CPU list"),
    ("a", "--cpus 'a': 'a' is not a CPU number N or a range N-M"),
    ("0,,1", "--cpus '0,,1': '' is not a CPU number"),
    ("-1", "--cpus '-1': '-1' is not a CPU number"),
    ("0-", "--cpus '0-': '0-' is not a CPU number"),
    ("3-1", "--cpus '3-1': range '3-1' runs backwards"),
    ("0-2,1", "--cpus '0-2,1': CPU 1 given twice"),
    ("0-99999999", "--cpus '0-99999999': CPU 99999999 in '0-99999999' is above 65535"),
    ("70000", "--cpus '70000': CPU 70000 in '70000' is above 65535"),
    ("\u0661", "--cpus '\u0661': '\u0661' is not a CPU number"),  # Arabic-Indic one: not [0-9]
])
def test_bad_lists_are_refused_naming_the_part(text, why):
    with pytest.raises(ConfigError, match=f"^{why.replace('(', '[(]')}"):
        parse_cpus(text)


def test_a_cpu_this_process_may_not_use_is_refused():
    usable = usable_cpus()
    require_usable(usable)
    with pytest.raises(ConfigError, match=f"CPU {max(usable) + 1} is not one this process may "
                       f"run on \\(usable: {format_cpus(usable)}\\)"):
        require_usable((max(usable) + 1,))


def test_a_huge_range_is_refused_before_it_is_expanded():
    with pytest.raises(ConfigError, match="CPU 3000000 in '0-3000000' is above 65535"):
        parse_cpus("0-3000000")
    assert len(parse_cpus("0-65535")) == 1 << 16  # the limit itself, with a linear check


def test_the_split_is_disjoint_and_even_while_there_are_enough_cpus():
    assert split_cpus((0, 1), 2) == [(0,), (1,)]
    assert split_cpus((0, 1), 1) == [(0, 1)]
    # every instance the same count (a role's instances share one engine configuration);
    # the remainder is left to the control plane
    assert split_cpus((0, 1, 2), 2) == [(0,), (1,)]
    assert split_cpus(tuple(range(4)), 3) == [(0,), (1,), (2,)]
    assert split_cpus(tuple(range(8)), 3) == [(0, 1), (2, 3), (4, 5)]
    assert split_cpus((1, 4, 5, 9), 2) == [(1, 4), (5, 9)]  # runs of the list, not of numbers
    assert split_cpus((2, 5, 6), 3) == [(2,), (5,), (6,)]
    assert split_cpus((0, 1), 3) == [(0,), (1,), (0,)]  # too few: shared round robin
    with pytest.raises(ConfigError, match="cannot split 2 CPUs among 0 instances"):
        split_cpus((0, 1), 0)
