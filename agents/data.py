"""
Prompt data sets: JSONL (one object per line), or Parquet when pyarrow is installed.

    for item in load_prompts("data/train.jsonl"):   # {"prompt": ..., "label": ..., "tools": ...}
        ...

A row is an object with `prompt` (a string) or `messages` (a list of chat messages, each with a `role` and a string
or text-parts `content`), and optionally `label` (anything JSON holds: an answer, test cases, a rubric) and `tools`
(OpenAI-format function specs). Other keys travel along untouched. A malformed row stops the load with one error
naming the file and the line (for Parquet, the row number, counting from 1).
"""
import json
import os

ROLES = ("system", "developer", "user", "assistant", "tool")


def load_prompts(path):
    """Yield the rows of a .jsonl (or .parquet) file, in file order, once each, after checking every row: a data set
    with a bad row fails before the first attempt, not hours into a run."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path!r} does not exist")
    rows = list(parquet_rows(path) if path.endswith(".parquet") else jsonl_rows(path))
    if not rows:
        raise ValueError(f"{path}: the file holds no rows")
    for line, row in rows:
        problem = row_problem(row)
        if problem:
            raise ValueError(f"{path}:{line}: {problem}")
    for _, row in rows:
        yield row


def jsonl_rows(path):
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                yield line, json.loads(text)
            except ValueError as e:
                raise ValueError(f"{path}:{line}: not valid JSON ({e})") from None


def parquet_rows(path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow); or convert the file to "
                          "JSONL") from None
    for i, row in enumerate(pq.read_table(path).to_pylist(), 1):
        # Parquet has no missing-key notion: a column absent from a row reads as None
        yield i, {k: v for k, v in row.items() if v is not None}


def row_problem(row):
    """What is wrong with one row, as a phrase, or None."""
    if not isinstance(row, dict):
        return f"a row must be a JSON object, got {type(row).__name__}"
    prompt, messages = row.get("prompt"), row.get("messages")
    if prompt is None and messages is None:
        return "the row has neither `prompt` nor `messages`"
    if prompt is not None and not isinstance(prompt, str):
        return f"`prompt` must be a string, got {type(prompt).__name__}"
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            return "`messages` must be a non-empty list of chat messages"
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                return f"`messages[{i}]` must be an object with a `role` among {', '.join(ROLES)}"
            content = m.get("content")
            if not (content is None or isinstance(content, str) or isinstance(content, list)):
                return f"`messages[{i}].content` must be a string or a list of text parts"
    tools = row.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            return "`tools` must be a list of OpenAI-format function specs"
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
                return f"`tools[{i}]` must look like {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
    return None
