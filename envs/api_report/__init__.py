"""`cgym/ApiReport-v0`: call API -> parse result -> write a JSON report."""

from cgym.envs.api_report.env import SYSTEM_PROMPT, ApiReportEnv
from cgym.envs.api_report.tasks import ReportTask

__all__ = ["ApiReportEnv", "ReportTask", "SYSTEM_PROMPT"]
