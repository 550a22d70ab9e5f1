"""`nccl-exporter hang`: is the job hung, and which rank never joined?"""

from __future__ import annotations

import json

from exporter.cli.common.options import CliError, parse_duration


def add_parser(sub) -> None:
    from exporter.offline.analysis.hang import DEFAULT_THRESHOLD_S, default_url

    p = sub.add_parser(
        "hang", help="is a job hung? which rank never entered the collective the others wait in",
        description="Read live agents' /metrics and, for every communicator with a call in flight "
                    "for at least --threshold, say which ranks wait in which collective (op and "
                    "sequence number), which member ranks never entered it, what each of those "
                    "last did (its last call here, a call it is in on another communicator, its "
                    "threads over the last second) and ranks of the same communicator inside "
                    "another collective (desync). Exit status: 0 no hang, 1 a hang, 2 bad input "
                    "or no agent answered (docs/alerts.md, 'NcclRankMissing').")
    p.add_argument("--metrics", metavar="URL", action="append", default=None,
                   help=f"an agent's /metrics; repeat for every node of the job (default {default_url()})")
    p.add_argument("--threshold", metavar="D", type=parse_duration, default=DEFAULT_THRESHOLD_S,
                   help=f"a call in flight this long is a hang (default {DEFAULT_THRESHOLD_S:g}s; "
                        "the NcclCollectiveHung and NcclRankMissing alerts use 5m)")
    p.add_argument("--format", choices=["text", "json"], default="text",
                   help="text (default): a verdict and a table; json: the same as one object")
    p.set_defaults(func=main)


def main(args) -> int:
    from exporter.offline.analysis import hang

    try:
        answer = hang.hang_status(args.metrics or [hang.default_url()], args.threshold)
    except hang.HangInputError as e:
        raise CliError(f"--metrics/--threshold: {e}") from None
    if not answer.answered:
        raise CliError(answer.verdict)
    if args.format == "json":
        print(json.dumps(answer.as_dict(), indent=1))
    else:
        print(answer.verdict)
        for line in answer.evidence:
            print("  - " + line)
    return 1 if answer.hung else 0
