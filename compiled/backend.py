"""The backend switch of the custom ops that have a Triton kernel beside their torch reference."""

from __future__ import annotations

import compiled.envs as envs

CHOICES = envs.BACKENDS   # "auto", "torch", "triton"


class BackendChoice:
    """'auto' (the kernel where it applies, the torch reference elsewhere), 'torch' or 'triton'.

    Starts from the environment variable `env` (read at the first use, so that importing the
    package never fails; unset means 'auto'). `configure` is how the engine config sets it: the
    environment, when set, wins over it. `set` sets it whatever the environment says (tests,
    benchmarks)."""

    def __init__(self, env: str) -> None:
        self.env = env
        self._name: str | None = None

    @property
    def name(self) -> str:
        if self._name is None:
            self._name = envs.read(self.env) or "auto"
        return self._name

    def check(self, name: str) -> str:
        if name not in CHOICES:
            raise ValueError(f"{self.env}={name!r}: expected one of {', '.join(CHOICES)}")
        return name

    def set(self, name: str) -> None:
        self._name = self.check(name)

    def configure(self, name: str) -> None:
        """Set `name` (the engine config's choice) unless the environment variable is set."""
        self.check(name)
        if not envs.is_set(self.env):
            self._name = name
