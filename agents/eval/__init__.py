"""Running and judging policies on envs: batched episodes, evaluations, the reward-hacking audit,
side-by-side comparisons with paired intervals, transcripts and reports. `cgym eval`, `compare`
and `audit` use this without importing the trainer."""
