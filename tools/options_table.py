"""docs/options.md: every option of the job request (memplan/request.py) with its key in a DeepSpeed config, in
Hugging Face TrainingArguments and in an Accelerate config, made from the fields' own metadata.

    python tools/options_table.py    # writes docs/options.md (tests/request/test_request.py checks it is current)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def table() -> str:
    from memplan.options import SCOPES
    from memplan.request import PARTS, keys

    out = ["# Options and the job files' keys", "",
           "Made by `python tools/options_table.py` from the request's fields (memplan/request.py): each option of "
           "`memplan estimate` (and of `check`, `plan` and `validate` where they take it), its part of the request, "
           "and the key that sets it in the job's own files. memplan reads those files with the same field names "
           "(memplan/jobfiles.py, memplan/dsconfig.py); the command line wins over TrainingArguments, which win over "
           "an Accelerate config, which wins over the ds_config; each value's source is in the JSON's "
           "`assumptions.setting_sources`. A key with no option is read from the file only. An option given to a job that "
           "does not read it (\"read by\") changes nothing, and the output says so in a note.", "",
           "| option | part | default | read by | ds_config | TrainingArguments | Accelerate config | what it is |",
           "|---|---|---|---|---|---|---|---|"]

    def cell(v: object) -> str:
        return f"`{v}`" if v not in (None, "") else ""

    for part, cls in PARTS.items():
        for name, default, key in keys(cls):
            if key.flag is None and not (key.ds_config or key.training_args or key.accelerate):
                continue
            flag = key.flag or f"({name}: files only)"
            shown = "" if default is None or default == "" else default
            read_by = SCOPES[key.scope][1] if key.scope else "every job"
            out.append(f"| {cell(flag) if key.flag else flag} | {part} | {cell(shown)} | {read_by} | "
                       f"{cell(key.ds_config)} | "
                       f"{cell(key.training_args)} | {cell(key.accelerate)} | {key.help.replace('|', '/')} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    (ROOT / "docs" / "options.md").write_text(table())
    print("wrote docs/options.md")
