"""`cgym/SqlQuery-v0`: multi-turn SQL generation with execution-based rewards and critiques.

Bundled seeded databases (shop, hr, flights), question templates at three difficulties, a
hardened read-only sandbox for model-written SQL, and `register_from_jsonl` to turn any
SQLite file plus a JSONL of questions into a registered env.
"""

from cgym.envs.sql.byo import JsonlSqlEnv, TaskFileError, load_tasks, register_from_jsonl
from cgym.envs.sql.checks import Verdict, default_rubric
from cgym.envs.sql.env import SYSTEM_PROMPT, SqlQueryEnv
from cgym.envs.sql.sandbox import QueryResult, Sandbox, SqlError
from cgym.envs.sql.tasks import SqlTask

__all__ = [
    "JsonlSqlEnv",
    "QueryResult",
    "SYSTEM_PROMPT",
    "Sandbox",
    "SqlError",
    "SqlQueryEnv",
    "SqlTask",
    "TaskFileError",
    "Verdict",
    "default_rubric",
    "load_tasks",
    "register_from_jsonl",
]
