"""`nanoinfer serve --help` (and the option table it prints) must not import torch: the help of a
CLI should come at once, not after seconds of loading the engine."""
import subprocess
import sys

import nanoinfer
from nanoinfer.config import Config


def test_serve_help_imports_no_torch():
    code = ("import sys\n"
            "from nanoinfer.serve.cli import main\n"
            "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'nanoinfer.llm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "--max-model-len" in out and "--served-model-name" in out  # the whole option table was printed
    assert out.strip().splitlines()[-1] == "HEAVY []"


def test_public_names_still_resolve():
    # the package loads its public names on first use: they must be the real classes
    from nanoinfer.data_parallel.llm import DataParallelEngines
    from nanoinfer.llm import LLM
    assert nanoinfer.LLM is LLM and LLM.data_parallel_backend is DataParallelEngines
    assert nanoinfer.SamplingParams.__module__ == "nanoinfer.sampling_params"
    try:
        nanoinfer.NoSuchName
    except AttributeError as e:
        assert "NoSuchName" in str(e)
    else:
        raise AssertionError("unknown attribute resolved")

