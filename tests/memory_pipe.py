"""An in-memory Connection end for driving the engine process's EngineCore inside the test process."""
import pickle


class MemoryPipe:
    """What it carries is pickled and unpickled, as by a real pipe."""

    def __init__(self):
        self.items = []

    def send(self, obj):
        self.items.append(pickle.loads(pickle.dumps(obj)))

    def poll(self, timeout: float = 0.0):
        return bool(self.items)

    def recv(self):
        return self.items.pop(0)


def drive_until_done(core, llm) -> int:
    """Run the EngineCore's loop by hand (commands, a step, the flush) until its requests are done;
    returns the number of steps."""
    steps = 0
    while not steps or core.requests:
        core._apply_commands()
        if not llm.is_finished():
            core._step()
            steps += 1
        core._flush()
    return steps
