"""Page-locked host memory, bounded: what this process pins, against a budget of the host's memory.

Page-locked ("pinned") memory is what makes a copy to an accelerator asynchronous, and it is RAM the kernel can
never reclaim: pinning too much leaves the system, or the container, swapping the rest or killing the process. So
every page-locked byte a storage takes is counted here, process-wide, against one budget:

- the budget is a share (:data:`PINNED_SHARE`) of the host's memory — the machine's ``MemTotal``, or the cgroup's
  limit when the process runs in a container with a lower one (``memory.max`` of cgroup v2,
  ``memory.limit_in_bytes`` of v1) — or what the environment variable ``MEMMODE_PINNED_BUDGET`` says (bytes, or
  ``"8GiB"``);
- a storage asks :meth:`HostPins.take` for the bytes it would pin, and is granted what is left of the budget; what
  it is not granted it keeps in pageable memory (its copies are then synchronous), and says so;
- it gives the bytes back (:meth:`HostPins.give`) when it unlocks them.

Sizes are exact: a storage asks for what it locks (``cudaHostRegister`` of exactly-sized slabs), not for
power-of-two blocks.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from memmode_core.contracts.options import byte_size

#: share of the host's memory this process may page-lock, by default
PINNED_SHARE = 0.5
#: the environment variable that sets the budget instead (bytes, or a size such as "8GiB")
BUDGET_VARIABLE = "MEMMODE_PINNED_BUDGET"
#: cgroup limits at or above this are "no limit" (v1 writes a huge number)
_UNLIMITED = 1 << 60


def host_memory() -> int | None:
    """Bytes of memory this process may use on the host: the machine's, or its cgroup's limit when lower (None
    where the system does not say)."""
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                limits.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < _UNLIMITED:
            limits.append(int(value))
    return min(limits, default=None)


class HostPins:
    """The process's page-locked bytes and their budget (see the module docstring)."""

    #: the environment variable that sets the budget (for messages)
    variable = BUDGET_VARIABLE

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pinned = 0
        self._budget: int | None = None
        self._budget_read = False

    @property
    def budget(self) -> int | None:
        """Bytes this process may page-lock (None: no bound known)."""
        if not self._budget_read:
            given = os.environ.get(BUDGET_VARIABLE)
            if given:
                try:
                    self._budget = byte_size(given)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{BUDGET_VARIABLE}={given!r}: {exc}") from None
            else:
                memory = host_memory()
                self._budget = None if memory is None else int(memory * PINNED_SHARE)
            self._budget_read = True
        return self._budget

    @budget.setter
    def budget(self, value: int | None) -> None:
        self._budget, self._budget_read = value, True

    def left(self) -> int | None:
        """Bytes still free to page-lock (None: no bound)."""
        budget = self.budget
        return None if budget is None else max(budget - self.pinned, 0)

    def take(self, nbytes: int) -> int:
        """Count up to ``nbytes`` of page-locked memory against the budget; returns what was granted."""
        budget = self.budget
        with self._lock:
            granted = nbytes if budget is None else max(min(nbytes, budget - self.pinned), 0)
            self.pinned += granted
            return granted

    def give(self, nbytes: int) -> None:
        """``nbytes`` taken earlier are unlocked."""
        with self._lock:
            self.pinned = max(self.pinned - nbytes, 0)


#: the process's page-locked memory
host_pins = HostPins()
