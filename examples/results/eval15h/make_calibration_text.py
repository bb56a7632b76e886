"""The 8K calibration text of eval15h: bash's manual page as plain prose (not an evaluation text).

SmolLM2's context is 8,192 tokens and the bundled LGPL-2.1 has fewer than that, so the 8K
calibration needs another text that no evaluation haystack contains: the manual of the `bash`
package of the machine (GNU Bash 5.x, Debian), rendered by `man` and joined into paragraphs.
`magicpig-jax calibrate` records the text's SHA-256 and paragraph hashes in its JSON, and the
eval refuses a calibration file whose text shares a paragraph with its haystack.

Run: python examples/results/eval15h/make_calibration_text.py OUT.txt
"""
import os
import re
import subprocess
import sys

raw = subprocess.run("man bash | col -b", shell=True, check=True, capture_output=True, text=True,
                     env=dict(os.environ, MANWIDTH="100")).stdout
raw = re.sub(r"\u2010\n\s*", "", raw)  # words hyphenated across lines by man
paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", raw)]
with open(sys.argv[1], "w") as f:
    f.write("\n\n".join(p for p in paragraphs if p))
