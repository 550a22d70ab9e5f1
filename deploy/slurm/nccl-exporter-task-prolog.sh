#!/bin/sh
# Slurm TaskProlog for nccl-exporter: gives every task of every job
# NCCL_PROFILER_PLUGIN, so NCCL loads the profiler plugin (GPU time per
# collective: docs/plugin.md). slurmd runs it before each task, as the job's
# user, and adds each "export NAME=value" line it prints to the task's
# environment (slurm.conf(5), TaskProlog). Install (docs/deploy.md, "Slurm"):
#
#   install -m 0755 deploy/slurm/nccl-exporter-task-prolog.sh /etc/slurm/
#   # slurm.conf on every node (or add a line to your existing TaskProlog):
#   TaskProlog=/etc/slurm/nccl-exporter-task-prolog.sh
#   scontrol reconfigure
#
# A job keeps what it set itself: NCCL_PROFILER_PLUGIN=none (or another
# plugin; chain ours with NCCL_EXPORTER_PROFILER_CHAIN instead) is left alone.
# Nothing is exported where the plugin file is missing (a node without the
# agent): NCCL would only log that it found no plugin.

plugin=${NCCL_EXPORTER_PLUGIN_FILE:-/opt/nccl-exporter/libnccl-profiler-exporter.so}

if [ -z "${NCCL_PROFILER_PLUGIN:-}" ] && [ -r "$plugin" ]; then
    echo "export NCCL_PROFILER_PLUGIN=$plugin"
fi
# Nothing else is needed: the launcher rank, SLURM_PROCID, is already in every
# task's environment, where the agent reads it (/proc/<pid>/environ).
exit 0
