#!/usr/bin/env bash
# Multi-Scale Table 4: sequence labelling
# 12 rows, 12 training runs, data: conll03-ner, conll12-ner, ptb-pos; configs/tables.yaml lists the rows.
#
#   bash scripts/tables/ms_table4.sh              # prepare data, train, average, evaluate, tabulate
#   bash scripts/tables/ms_table4.sh --dry-run    # print the plan and every command; run nothing
#   bash scripts/tables/ms_table4.sh --stages evaluate,table   # more options: fairseq-plugins-reproduce -h
#
# Settings: edit them here, or set them in the environment (GPUS=4 bash scripts/tables/ms_table4.sh).
GPUS=${GPUS:-1}                     # GPUs per node (the configs assume 1 GPU); 0 = CPU
UPDATE_FREQ=${UPDATE_FREQ:-auto}    # batches per update; auto = keep the paper's batch on GPUS x NNODES
NNODES=${NNODES:-1}                 # nodes; run this script on each one, with its NODE_RANK
NODE_RANK=${NODE_RANK:-0}           # this node (0 also evaluates and writes the table)
MASTER_ADDR=${MASTER_ADDR:-}        # address of node 0, when NNODES > 1
FP16=${FP16---fp16}                 # mixed precision (GPU); FP16= (empty) for fp32, and on CPU

set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python}" -m fairseq_plugins.recipes.reproduce_table ms-table4 --world-size "$GPUS" --update-freq "$UPDATE_FREQ" \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" $FP16 "$@"
