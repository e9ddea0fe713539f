"""A tensor-parallel (or data-parallel) engine spawns its workers, and a spawned process re-imports
the main script: made outside an `if __name__ == "__main__":` guard, the engine would be made again
in every worker (which then dies with an obscure start-up error). Checked before any worker is
spawned."""
import ast
import multiprocessing
import sys

HELP = ('{what} starts worker processes with "spawn", which re-import the main script; '
        'make the LLM under an `if __name__ == "__main__":` guard')


def check_main_guard(what: str = "tensor_parallel_size > 1"):
    """Raise RuntimeError when an engine with worker processes (`what` has them) is being made
    where spawned workers would make it again."""
    help_text = HELP.format(what=what)
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # (multiprocessing's own test)
        raise RuntimeError(f"an LLM with {what} is being made while a spawned process imports the main "
                           f"script: {help_text}")
    line = _unguarded_main_line()
    if line is not None:
        raise RuntimeError(f"an LLM with {what} is made at line {line} of the main script "
                           f"({sys.modules['__main__'].__file__}), outside an `if __name__ == \"__main__\":` "
                           f"block: {help_text}")


def _unguarded_main_line() -> int | None:
    """The line of the main script's top-level statement that is making the engine, when that
    statement is not an `if __name__ == "__main__":` block; None otherwise (or when unknown: an
    interactive session, a main module without a readable file)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None or not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    line = frame.f_lineno
    for node in tree.body:
        if node.lineno <= line <= node.end_lineno:
            return None if _is_main_guard(node) else line
    return None


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.ops) != 1 \
            or not isinstance(node.test.ops[0], ast.Eq):
        return False
    sides = [node.test.left, node.test.comparators[0]]
    names = {s.id for s in sides if isinstance(s, ast.Name)}
    consts = {s.value for s in sides if isinstance(s, ast.Constant)}
    return names == {"__name__"} and consts == {"__main__"}
