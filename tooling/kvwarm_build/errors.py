"""One error type for every refusal of the build tooling."""


class BuildError(Exception):
    """A refusal with what went wrong and how to fix it.

    The CLI prints ``str(err)`` without a traceback, so the message must name the input
    (file, release, patch) and the fix.
    """

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}\n  fix: {fix}")
        self.problem = problem
        self.fix = fix
