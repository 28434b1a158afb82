"""deepinfer.text stays torch-free: API processes tokenize without loading torch."""

from __future__ import annotations

import subprocess
import sys


def test_text_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import deepinfer.text.tokenizer, deepinfer.text.recipe\n"
        "import deepinfer.text.detokenizer, deepinfer.text.stop\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
