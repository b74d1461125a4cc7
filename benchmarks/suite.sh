#!/usr/bin/env bash
# The `shardtune bench` runs behind benchmarks/RESULTS.md, by machine:
#
#   benchmarks/suite.sh SUITE RESULTS_DIR
#
# SUITE: h100 (the seed's setting on alpaca-like data against HF Trainer + PEFT, FlexAttention for packed
# sequences, liger-kernel), h100-default (the default config against HF Trainer + PEFT), h100-long (the
# longest sequence on one 80 GB GPU), h200 (1 GPU against HF Trainer + PEFT's best setting, and the 1-GPU
# references of the 2-GPU runs), h200x2 (DDP scaling, FSDP2 full fine-tuning), h200-profile (where a step's
# time goes), h200x2-scaling (1 and 2 GPUs of one machine), h200-speed (batch 4, packed batches of one
# shape), h200x2-ddp (DDP against one GPU of the same machine), h200x2-default (the default config's DDP
# scaling), h200x2-ep (issue 22: expert parallelism against FSDP on 2 GPUs, LoRA on attention and the routed
# experts, then on attention alone), h200x2-ep-probe (where an EP 2 step goes, 12 layers), flex-graphs (CUDA graphs under FlexAttention at the seed's setting, against none), h200x2-moe-ddp (auto's DDP for an adapter against FSDP and one
# GPU: Qwen3-30B-A3B LoRA on attention and the routed experts), h200x2-moe-ddp-80gb (that DDP run on 2 GPUs of 80 GB, emulated:
# the planner given an H100's memory, the allocator held to it), x4-scaling / x8-scaling and
# x4-jobs / x8-jobs (issue 11, on 4 or 8 GPUs), h200-moe (issue 20's
# MoE targets against HF Trainer + PEFT on 1 GPU, split in h200-moe-qwen3 and h200-moe-large; profile=1
# adds a profile), h200-moe-default (those runs in the default config: checkpointing auto, HF at its best
# setting that fits), h200-moe-profile (the GEMM share of the Qwen3-30B-A3B LoRA step's device time) and
# h200-grouped-gemm (model.grouped_gemm: quack's kernels against torch._grouped_mm, kernels and steps; needs
# shardtune[quack]), moe-loss (the chunked loss: the loss alone, and Qwen3-30B-A3B against HF),
# checkpoint-parts (auto recomputing parts of layers against whole layers; BENCH_ONLY splits it: the first
# four runs on an 80 GB GPU, the others on one H200), compiled-loss (the chunked loss's softmax compiled:
# the loss alone, and the routed-expert run under HF's peak; BENCH_ONLY: loss-kernels and run names),
# weighted-silu (the weighted SiLU's backward kernel: the MoE kernels alone, and the three Qwen3-30B-A3B and
# GLM-4.5-Air runs against HF; BENCH_ONLY: moe-kernels and run names), gathered (the down projection's input
# gradient gathering its rows in quack's GEMM: the MoE kernels, and the Qwen3-30B-A3B, GLM-4.5-Air and Mixtral runs
# against HF; BENCH_ONLY as for weighted-silu), quack-tiles (quack's tile configurations: every SM90 one on the
# MoE GEMMs, and the Qwen3-30B-A3B, GLM-4.5-Air and Mixtral runs against HF; BENCH_ONLY as for weighted-silu),
# routing-kernels (the router's top-k and the expert order as Triton kernels: the routing bookkeeping alone, and the
# Qwen3-30B-A3B and GLM-4.5-Air runs against HF; BENCH_ONLY as for weighted-silu), host-overhead (whether the Qwen3-30B-A3B
# step waits on the host, and inductor settings against the default, 32 layers on an 80 GB GPU), float8
# (model.float8_experts and float8_linear: the GEMMs alone, steps against bf16's on an 80 GB GPU, and the
# Qwen3-30B-A3B and GLM-4.5-Air runs against HF on one H200; BENCH_ONLY: moe-kernels and run names; BENCH_CODE: another
# checkout's package timed in turn with this one's, f8-code-*), float8-gemm (the float8 experts' grouped GEMM:
# shardtune's Triton kernel against torch's, alternating on an 80 GB GPU; BENCH_ONLY: moe-kernels and run names),
# device-wait (where the Qwen3-30B-A3B float8 step on one H200 waits with the host unslowed by the profiler, and
# each step's GPU clock and power; BENCH_CODE: another checkout's package profiled the same way, wait-code), shared-gemms
# (LoRA's down-projections on one input as one GEMM: one layer with and without, and with BENCH_CODE whole steps
# alternating with another checkout's package), cuda-graphs (the compiled decoder layers replayed as CUDA graphs against
# the same layers without, alternating in one call: Qwen3-30B-A3B LoRA attention, both float8 options, all 48 layers, on
# one H200; then the Qwen3-30B-A3B and GLM-4.5-Air float8 runs against HF, and Qwen3-30B-A3B's default config (bf16)
# against HF, the routed-expert run (float8) and Mixtral-8x7B (default) against HF; BENCH_ONLY: run names), gemm-share (issue 20's GEMM share of device time: two profiled steps of the MoE
# shapes whose GEMMs outweigh their attention most, GLM-4.5-Air at 20 layers and Mixtral-8x7B, in the default config
# and with both float8 options, and Llama 4 Scout's first 12 layers in the default config; BENCH_ONLY: run names), ddp-graphs (the CUDA graphs under DDP on 2 GPUs against the same
# layers without, alternating: Qwen3-30B-A3B LoRA attention, 24 layers, both float8 options), more-moe (DeepSeek-V2-Lite,
# ERNIE-4.5-21B-A3B and gpt-oss-20b against HF, LoRA on attention, then on the routed experts too), llama4 (Llama 4
# Scout's first 12 layers against HF, the same two runs), gemma4 (Gemma 4 26B-A4B's text model against HF, the same two
# runs, and a profiled run, gemma4-26b-a4b-profile), last-moe (LFM2-8B-A1B, Phi-3.5-MoE's first 16 layers, JetMoE-8B and
# DBRX's first 8 layers against HF, the same two runs, DBRX's LoRA-attention one only, and JetMoE's and DBRX's
# LoRA-attention runs with both float8 options, -float8; BENCH_ONLY: run names), gptoss-glu (gpt-oss-20b, LoRA on
# attention + routed experts, then on attention, no baseline: GPT-OSS's clamped GLU keeping only its gate/up output),
# gptoss-padded (gpt-oss-20b without packing: FlexAttention, then eager attention, its scores recomputed where they do
# not fit; BENCH_ONLY: run names), gemma-dense (Gemma 2 9B, which has no sdpa, on FlexAttention with padded rows and
# with packed rows, and Gemma 3 12B's text model on sdpa: LoRA, the default config, no baseline; BENCH_ONLY: run
# names). Each run's bench.json (and profile report, where one is taken) is copied to
# RESULTS_DIR/<run>.json; a run that fails is logged and the suite goes on.
set -uo pipefail
suite=$1
results=$(realpath -m "$2")
work=${BENCH_WORK:-/tmp/shardtune-bench}
mkdir -p "$results" "$work"
export PYTHONUNBUFFERED=1

bench() {  # NAME ARGS...: one `shardtune bench` run into $work/NAME; fails when it fails or is left out
    local name=$1
    shift
    # BENCH_ONLY: the names of the runs to make (space-separated), to split a suite over several calls. A run left
    # out returns 2, so that what follows it with && (a profile's report) is left out with it.
    if [[ -n ${BENCH_ONLY:-} && " $BENCH_ONLY " != *" $name "* ]]; then
        return 2
    fi
    echo "=== $name: shardtune bench $*"
    local started=$SECONDS
    # BENCH_RUN_LIMIT (seconds): a run that takes longer is stopped, and the suite goes on.
    if ${BENCH_RUN_LIMIT:+timeout "$BENCH_RUN_LIMIT"} python3 -m shardtune bench --out "$work/$name" "$@" \
        >"$work/$name.out" 2>&1; then
        cp "$work/$name/bench.json" "$results/$name.json"
        if [[ -f "$work/$name/shardtune/profile/rank0.txt" ]]; then
            head -c 12000 "$work/$name/shardtune/profile/rank0.txt" >"$results/$name.profile.txt"
            if [[ -f "$work/$name/shardtune/profile/rank1.txt" ]]; then
                head -c 12000 "$work/$name/shardtune/profile/rank1.txt" >"$results/$name.profile-rank1.txt"
            fi
        fi
        tail -n 6 "$work/$name.out"
        # Whether the layers were replayed as CUDA graphs, given up or failed to capture (a capture in the measured steps
        # costs them its time).
        grep -h "cuda graphs" "$work/$name.out" "$work/$name/shardtune.log" 2>/dev/null | sort -u | head -n 4
        # With TORCH_LOGS=recompiles: how often a compiled layer met a shape it had not seen.
        echo "recompilations: $(grep -c 'Recompiling function' "$work/$name.out")"
    else
        echo "--- $name failed:"
        tail -n 25 "$work/$name.out"
        tail -n 40 "$work/$name/shardtune.log" 2>/dev/null | grep -v "^\s*$" | tail -n 25
        return 1
    fi
    echo "--- $name took $((SECONDS - started)) s"
}

mistral=(--shape mistral-7b)
compiled=(parallel.compile=true)
seed_setting=(--seq 512 --batch 1 --data alpaca-like)
case $suite in
h100)
    bench seed "${mistral[@]}" "${seed_setting[@]}" --steps 30 --warmup 10 --baseline hf "${compiled[@]}" \
        'logging.profile_steps=[6,8]'
    bench seed-flex "${mistral[@]}" "${seed_setting[@]}" --steps 30 --warmup 10 "${compiled[@]}" \
        model.attn_implementation=flex_attention
    bench liger "${mistral[@]}" --seq 4096 --batch 2 --steps 6 --warmup 4 "${compiled[@]}" model.liger_kernel=true
    ;;
h100-default)
    # Issue 21: the default config (no speed overrides: parallel.compile is auto, on for CUDA) against HF
    # Trainer + PEFT in the same run, at seq 4096 with checkpointing and at the seed's setting. BENCH_CODE: a
    # directory holding another shardtune package to time instead (the "before" of a change), same commands.
    # seed_only=1 runs the seed's setting alone; BENCH_OVERRIDES: settings added to every run.
    code=${BENCH_CODE:-.}
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    baseline=(--baseline hf)
    [[ ${seed_only:-0} == 1 ]] && baseline=()
    [[ ${seed_only:-0} == 1 ]] || (cd "$code" && bench default-4096 "${mistral[@]}" --seq 4096 --batch 2 \
        --gradient-checkpointing --steps 8 --warmup 4 --baseline hf "${extra[@]}")
    (cd "$code" && bench seed-default "${mistral[@]}" "${seed_setting[@]}" --steps 40 --warmup 15 "${baseline[@]}" \
        "${extra[@]}")
    ;;
h100-long)
    long=(--batch 1 --steps 1 --warmup 0 --gradient-checkpointing training.loss_chunk_tokens=8192
        training.mlp_chunk_tokens=16384 training.activation_offloading=true)
    bench long-256k "${mistral[@]}" --seq 262144 "${long[@]}" || bench long-128k "${mistral[@]}" --seq 131072 "${long[@]}"
    ;;
h200)
    bench 4096-1gpu "${mistral[@]}" --seq 4096 --batch 2 --steps 8 --warmup 4 --baseline hf "${compiled[@]}"
    bench seed-1gpu "${mistral[@]}" "${seed_setting[@]}" --steps 30 --warmup 10 --baseline hf "${compiled[@]}"
    ;;
h200-profile)
    bench seed-profile "${mistral[@]}" "${seed_setting[@]}" --steps 3 --warmup 30 "${compiled[@]}" \
        'logging.profile_steps=[26,28]'
    bench 4096-b4 "${mistral[@]}" --seq 4096 --batch 4 --steps 6 --warmup 4 "${compiled[@]}"
    bench 4096-profile "${mistral[@]}" --seq 4096 --batch 2 --steps 2 --warmup 10 "${compiled[@]}" \
        'logging.profile_steps=[8,9]'
    ;;
h200-speed)
    TORCH_LOGS=recompiles bench seed-fixed "${mistral[@]}" "${seed_setting[@]}" --steps 20 --warmup 8 \
        "${compiled[@]}" data.pad_to=max_length
    bench 4096-b2 "${mistral[@]}" --seq 4096 --batch 2 --steps 8 --warmup 4 "${compiled[@]}"
    bench 4096-b4 "${mistral[@]}" --seq 4096 --batch 4 --steps 6 --warmup 4 "${compiled[@]}"
    ;;
h200x2-ddp)
    # DDP against one GPU of the same machine (--nproc 1), at seq 4096 and at the seed's setting (packed
    # batches of one shape). profile=1 adds a profile of two warm-up steps to the seq 4096 runs.
    profiled=()
    [[ ${profile:-0} == 1 ]] && profiled=('logging.profile_steps=[5,6]')
    bench 4096-ddp "${mistral[@]}" --seq 4096 --batch 2 --steps 8 --warmup 7 --strategy ddp "${compiled[@]}" \
        "${profiled[@]}"
    bench 4096-1of2 "${mistral[@]}" --seq 4096 --batch 2 --steps 8 --warmup 7 --nproc 1 "${compiled[@]}" "${profiled[@]}"
    TORCH_LOGS=recompiles bench seed-fixed-ddp "${mistral[@]}" "${seed_setting[@]}" --steps 20 --warmup 10 \
        --strategy ddp "${compiled[@]}" data.pad_to=max_length
    bench seed-fixed-1of2 "${mistral[@]}" "${seed_setting[@]}" --steps 20 --warmup 10 --nproc 1 "${compiled[@]}" \
        data.pad_to=max_length
    ;;
h200x2-default)
    # Issue 23, runs 2 and 3: the default config (no speed overrides) with DDP on 2 GPUs against one GPU of
    # the same machine (--nproc 1): the seed's setting (targets: >= 95% scaling) with a profile of both ranks,
    # and seq 4096 (>= 98%).
    bench seed-default-ddp "${mistral[@]}" "${seed_setting[@]}" --steps 40 --warmup 20 --strategy ddp \
        'logging.profile_steps=[12,14]'
    bench seed-default-1of2 "${mistral[@]}" "${seed_setting[@]}" --steps 40 --warmup 20 --nproc 1 \
        'logging.profile_steps=[12,14]'
    bench 4096-default-ddp "${mistral[@]}" --seq 4096 --batch 2 --gradient-checkpointing --steps 8 --warmup 4 \
        --strategy ddp
    bench 4096-default-1of2 "${mistral[@]}" --seq 4096 --batch 2 --gradient-checkpointing --steps 8 --warmup 4 \
        --nproc 1
    ;;
h200x2-ep)
    # Issue 22's 2-GPU measurement (the issue "2-GPU runs: expert parallelism against FSDP, and data-parallel
    # scaling"): parallel.expert_parallel_size=2 (each GPU holds half the routed experts, tokens move by
    # all-to-all) against FSDP2 alone (each MoE layer's experts all-gathered to run), LoRA on attention and the
    # routed experts, seq 4096, batch 2, checkpointing; Qwen3-30B-A3B and GLM-4.5-Air's first 12 layers; and
    # EP 1 on one GPU of the same machine (--nproc 1: the new mesh at its smallest, the data-parallel
    # reference).
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    ep=(--seq 4096 --batch 2 --gradient-checkpointing --steps 8 --warmup 4 'lora.moe_targets=[attention,routed_experts]'
        "${extra[@]}")
    bench ep-qwen3-1of2 --shape qwen3-30b-a3b "${ep[@]}" --nproc 1
    bench ep-qwen3-fsdp --shape qwen3-30b-a3b "${ep[@]}" --nproc 2 --strategy fsdp
    bench ep-qwen3-ep2 --shape qwen3-30b-a3b "${ep[@]}" --nproc 2 --strategy fsdp parallel.expert_parallel_size=2
    # DDP: the whole model on each GPU, where it fits (the planner: 68.95 of 71.64 GiB on an 80 GB GPU), no gathers
    bench ep-qwen3-ddp --shape qwen3-30b-a3b "${ep[@]}" --nproc 2 --strategy ddp
    bench ep-air12-fsdp --shape glm-4.5-air --layers 12 "${ep[@]}" --nproc 2 --strategy fsdp
    bench ep-air12-ep2 --shape glm-4.5-air --layers 12 "${ep[@]}" --nproc 2 --strategy fsdp \
        parallel.expert_parallel_size=2
    # LoRA on attention alone (the MoE default): the routed experts are frozen, so FSDP alone gathers them
    # and reduces nothing for them, where EP 2 moves tokens instead.
    attn=(--seq 4096 --batch 2 --gradient-checkpointing --steps 8 --warmup 4 "${extra[@]}")
    bench ep-qwen3-attn-1of2 --shape qwen3-30b-a3b "${attn[@]}" --nproc 1
    bench ep-qwen3-attn-fsdp --shape qwen3-30b-a3b "${attn[@]}" --nproc 2 --strategy fsdp
    bench ep-qwen3-attn-ep2 --shape qwen3-30b-a3b "${attn[@]}" --nproc 2 --strategy fsdp \
        parallel.expert_parallel_size=2
    ;;
flex-graphs)
    # CUDA graphs under FlexAttention: the seed's setting in the default config (packed rows, so auto attention is
    # flex_attention on a GPU) with the layers replayed as graphs, and without; one GPU.
    bench seed-graphs "${mistral[@]}" "${seed_setting[@]}" --steps 40 --warmup 20
    bench seed-nographs "${mistral[@]}" "${seed_setting[@]}" --steps 40 --warmup 20 parallel.cuda_graphs=false
    ;;
h200x2-moe-ddp)
    # parallel.strategy auto for an adapter on 2 GPUs: DDP wherever a DDP step's memory estimate fits, against FSDP
    # (which gathers the frozen experts every step) and one GPU of the same machine. Qwen3-30B-A3B, LoRA on attention
    # and the routed experts, seq 4096, batch 2 a GPU; checkpointing auto, and every layer (the only DDP setting
    # that fits an 80 GB GPU; on one, moe-auto is DDP recomputing what it must).
    moe=(--shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 8 --warmup 4 'lora.moe_targets=[attention,routed_experts]')
    bench moe-auto "${moe[@]}" --nproc 2
    bench moe-ddp "${moe[@]}" --nproc 2 --strategy ddp
    bench moe-fsdp "${moe[@]}" --nproc 2 --strategy fsdp
    bench moe-1of2 "${moe[@]}" --nproc 1
    bench moe-ddp-every "${moe[@]}" --nproc 2 --strategy ddp --gradient-checkpointing
    bench moe-1of2-every "${moe[@]}" --nproc 1 --gradient-checkpointing
    ;;
h200x2-moe-ddp-80gb)
    # auto's DDP for the adapter above on 2 GPUs of 80 GB, emulated on bigger GPUs: the planner is given an 80 GB
    # H100's usable memory (training.memory_budget_gib=71.3, 90% of the 79.19 GiB torch reports there), each worker's
    # allocator is held to 78 GiB (benchmarks/emulated_memory), and nvidia-smi's memory.used of every GPU (allocator,
    # CUDA context and NCCL together) is sampled into RESULTS_DIR/memory-used.csv: the run fits an H100 where its
    # largest sample is below the 81,559 MiB nvidia-smi gives an H100 80GB.
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 >"$results/memory-used.csv" &
    sampler=$!
    PYTHONPATH=$(dirname "$0")/emulated_memory${PYTHONPATH:+:$PYTHONPATH} SHARDTUNE_BENCH_ALLOCATOR_GIB=78 \
        bench moe-auto-80gb-emulated --shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 8 --warmup 4 --nproc 2 \
        'lora.moe_targets=[attention,routed_experts]' training.memory_budget_gib=71.3
    kill "$sampler"
    awk -F', *' '$2 > most[$1] { most[$1] = $2 } END { for (gpu in most) printf "GPU %s: largest memory.used %d MiB\n", gpu, most[gpu] }' \
        "$results/memory-used.csv"
    ;;
h200x2-ep-probe)
    # Where an EP 2 step goes (issue 23), 12 layers: EP 2 with two profiled warm-up steps (read its trace with
    # python benchmarks/device_gaps.py WORK/ep12-ep2-profile/shardtune/profile/rank0.trace.json.gz, WORK being
    # BENCH_WORK, /tmp/shardtune-bench by default),
    # FSDP alone, EP 2 uncompiled, and one GPU of the machine.
    probe=(--shape qwen3-30b-a3b --layers 12 --seq 4096 --batch 2 --gradient-checkpointing --steps 6 --warmup 5
        'lora.moe_targets=[attention,routed_experts]')
    bench ep12-ep2-profile "${probe[@]}" --nproc 2 --strategy fsdp parallel.expert_parallel_size=2 \
        'logging.profile_steps=[3,4]'
    bench ep12-fsdp "${probe[@]}" --nproc 2 --strategy fsdp
    bench ep12-ep2-eager "${probe[@]}" --nproc 2 --strategy fsdp parallel.expert_parallel_size=2 parallel.compile=false
    bench ep12-1of2 "${probe[@]}" --nproc 1
    ;;
h200x2-scaling)
    bench 4096-1of2 "${mistral[@]}" --seq 4096 --batch 2 --steps 8 --warmup 4 --nproc 1 "${compiled[@]}"
    bench 4096-ddp "${mistral[@]}" --seq 4096 --batch 2 --steps 8 --warmup 4 --strategy ddp "${compiled[@]}"
    bench seed-1of2 "${mistral[@]}" "${seed_setting[@]}" --steps 20 --warmup 8 --nproc 1 "${compiled[@]}"
    bench seed-ddp "${mistral[@]}" "${seed_setting[@]}" --steps 20 --warmup 8 --strategy ddp "${compiled[@]}"
    ;;
h200x2)
    bench 4096-ddp "${mistral[@]}" --seq 4096 --batch 2 --steps 8 --warmup 4 --strategy ddp "${compiled[@]}"
    bench seed-ddp "${mistral[@]}" "${seed_setting[@]}" --steps 30 --warmup 10 --strategy ddp "${compiled[@]}"
    bench llama3-8b-full-fsdp --shape llama3-8b --full --seq 4096 --batch 2 --steps 6 --warmup 4 --strategy fsdp \
        "${compiled[@]}" ||
        bench llama3-8b-full-fsdp-b1 --shape llama3-8b --full --seq 4096 --batch 1 --steps 8 --warmup 4 \
            --strategy fsdp "${compiled[@]}" ||
        bench llama3-8b-full-fsdp-ac --shape llama3-8b --full --seq 4096 --batch 2 --steps 6 --warmup 4 \
            --strategy fsdp --gradient-checkpointing "${compiled[@]}"
    ;;
x4-scaling | x8-scaling)
    # Issue 11, run 1: LoRA scaling at seq 4096 from 1 GPU to all of the machine's, DDP and FSDP2.
    gpus=${suite:1:1}
    bench 4096-1of$gpus "${mistral[@]}" --seq 4096 --batch 2 --steps 8 --warmup 5 --nproc 1 "${compiled[@]}"
    for n in 2 4 8; do
        ((n > gpus)) && break
        bench 4096-ddp-$n "${mistral[@]}" --seq 4096 --batch 2 --steps 8 --warmup 5 --nproc $n --strategy ddp \
            "${compiled[@]}"
        bench 4096-fsdp-$n "${mistral[@]}" --seq 4096 --batch 2 --steps 8 --warmup 5 --nproc $n --strategy fsdp \
            "${compiled[@]}"
    done
    ;;
x4-jobs | x8-jobs)
    # Issue 11, runs 2 and 3: the seed 002 job (LoRA r=8, alpha 16, dropout 0.05 on the 7 projections,
    # seq 512, alpaca-like lengths, DDP on every GPU) timed over one epoch of 2,048 examples; then full
    # fine-tuning of the llama3-8b shape with FSDP2 on every GPU.
    gpus=${suite:1:1}
    bench seed002-$gpus "${mistral[@]}" --seq 512 --batch 1 --data alpaca-like --epoch-examples 2048 --warmup 10 \
        --nproc "$gpus" --strategy ddp --lora-r 8 --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj \
        "${compiled[@]}" lora.lora_dropout=0.05 data.pad_to=max_length
    bench llama3-8b-full-fsdp-$gpus --shape llama3-8b --full --seq 4096 --batch 2 --steps 6 --warmup 4 \
        --nproc "$gpus" --strategy fsdp "${compiled[@]}"
    ;;
h200-moe | h200-moe-qwen3 | h200-moe-large)
    # Issue 20's targets, each against HF Trainer + PEFT in the same run, 1 H200 (141 GB), seq 4096, batch 2,
    # activation checkpointing (HF's baseline needs it to fit), skewed routing (bench's default: a trained
    # model's long-tailed load), LoRA r=16. h200-moe-qwen3 (the Qwen3-30B-A3B runs) and h200-moe-large (GLM-4.5-Air,
    # Mixtral) each fit one 10-minute device call; h200-moe runs both. profile=1 adds a profile of two warm-up
    # steps to the first run (its GEMM share: h200-moe-profile).
    # BENCH_OVERRIDES: section.key=value settings added to every run, e.g. "parallel.compile=true".
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    moe=(--seq 4096 --batch 2 --gradient-checkpointing --steps 3 --warmup 3 --baseline hf "${extra[@]}")
    profiled=()
    [[ ${profile:-0} == 1 ]] && profiled=('logging.profile_steps=[2,3]')
    if [[ $suite != h200-moe-large ]]; then
        bench moe-qwen3-attn --shape qwen3-30b-a3b "${moe[@]}" "${profiled[@]}"
        bench moe-qwen3-experts --shape qwen3-30b-a3b "${moe[@]}" 'lora.moe_targets=[attention,routed_experts]'
        bench moe-qwen3-attn-random --shape qwen3-30b-a3b "${moe[@]}" --routing random
    fi
    if [[ $suite != h200-moe-qwen3 ]]; then
        # GLM-4.5-Air: 1 dense + 19 sparse layers. bf16 weights: 2.5 GB embedding and head, 0.24 GB the dense
        # layer, 4.7 GB each sparse one (128 experts of 3 x 4096 x 1408, attention 0.11 GB): 92 GB, which
        # leaves HF's baseline about 45 GB for activations, logits and the loss (Qwen3-30B-A3B needed 19 GB
        # beyond its 61 GB of weights). 24 layers (111 GB) is the most that could fit at all.
        bench moe-glm-air-20l --shape glm-4.5-air --layers 20 "${moe[@]}"
        # Mixtral-8x7B whole: 46.7B parameters, 93 GB in bf16; its small vocabulary keeps the logits at 1 GB.
        bench moe-mixtral --shape mixtral-8x7b "${moe[@]}"
    fi
    ;;
h200-moe-default)
    # Issue 20's runs in the default config: gradient_checkpointing auto (the fewest layers that fit), and the HF
    # baseline at its best setting that fits (without checkpointing, or with it when it runs out of memory).
    # Two runs fit one 10-minute device call: BENCH_ONLY picks them. The last run is the profile of the first
    # one's step (two profiled steps after warm-up, and the share of its device time in GEMM kernels).
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    moe=(--seq 4096 --batch 2 --steps 3 --warmup 3 --baseline hf "${extra[@]}")
    bench auto-qwen3-attn --shape qwen3-30b-a3b "${moe[@]}"
    bench auto-qwen3-experts --shape qwen3-30b-a3b "${moe[@]}" 'lora.moe_targets=[attention,routed_experts]'
    bench auto-glm-air-20l --shape glm-4.5-air --layers 20 "${moe[@]}"
    bench auto-mixtral --shape mixtral-8x7b "${moe[@]}"
    bench auto-qwen3-attn-random --shape qwen3-30b-a3b "${moe[@]}" --routing random
    # Every layer checkpointed on both sides: the routed-expert run at HF's memory.
    bench auto-qwen3-experts-every --shape qwen3-30b-a3b "${moe[@]}" --gradient-checkpointing \
        'lora.moe_targets=[attention,routed_experts]'
    # The routed-expert run held under HF's peak (79.6 GiB, every layer checkpointed): auto checkpoints the fewest
    # layers whose estimate fits 75 GiB (the estimate errs up to 5% low on these runs).
    bench auto-qwen3-experts-budget --shape qwen3-30b-a3b "${moe[@]}" 'lora.moe_targets=[attention,routed_experts]' \
        training.memory_budget_gib=75
    bench auto-qwen3-attn-profile --shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 2 --warmup 4 \
        'logging.profile_steps=[3,4]' "${extra[@]}"
    trace=$work/auto-qwen3-attn-profile/shardtune/profile/rank0.trace.json.gz
    [[ -f $trace ]] && python3 -m shardtune.bench.profile_share "$trace" | tee "$results/auto-qwen3-attn-profile.gemm.txt"
    ;;
checkpoint-parts)
    # gradient_checkpointing auto recomputing parts of layers (a layer's attention, then its MoE block too)
    # against whole layers only (training.gradient_checkpointing_granularity=layer, the earlier auto), each
    # pair in one device call. On an 80 GB GPU (h100), and on one H200 held under HF + PEFT's peak (79.6 GiB):
    # the routed-expert run at memory budgets of 75 and 78.5 GiB, against HF in the same run; and Mixtral-8x7B.
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    qwen3=(--shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 3 --warmup 3 "${extra[@]}")
    experts='lora.moe_targets=[attention,routed_experts]'
    layers=training.gradient_checkpointing_granularity=layer
    bench parts-qwen3-experts "${qwen3[@]}" "$experts"
    bench parts-qwen3-experts-layers "${qwen3[@]}" "$experts" "$layers"
    bench parts-qwen3-attn "${qwen3[@]}"
    bench parts-qwen3-attn-layers "${qwen3[@]}" "$layers"
    bench parts-qwen3-experts-budget-layers "${qwen3[@]}" "$experts" training.memory_budget_gib=75 "$layers"
    bench parts-qwen3-experts-budget "${qwen3[@]}" "$experts" training.memory_budget_gib=75 --baseline hf
    bench parts-qwen3-experts-budget785 "${qwen3[@]}" "$experts" training.memory_budget_gib=78.5 --baseline hf
    bench parts-mixtral --shape mixtral-8x7b --seq 4096 --batch 2 --steps 3 --warmup 3 --baseline hf "${extra[@]}"
    bench parts-mixtral-layers --shape mixtral-8x7b --seq 4096 --batch 2 --steps 3 --warmup 3 "$layers" "${extra[@]}"
    ;;
compiled-loss)
    # The chunked loss's softmax compiled (under parallel.compile, the default on CUDA): the loss alone (eager
    # and compiled chunks), then on one H200 the routed-expert run held under HF + PEFT's peak (79.6 GiB) at
    # memory budgets of 79 and 79.5 GiB, Qwen3 LoRA on attention and GLM-4.5-Air (20 layers), each against HF
    # in the same run.
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    qwen3=(--shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 3 --warmup 3 --baseline hf "${extra[@]}")
    if [[ -z ${BENCH_ONLY:-} || " $BENCH_ONLY " == *" loss-kernels "* ]]; then
        python3 benchmarks/loss_kernels.py --out "$results/loss_kernels.txt"
    fi
    for budget in 79 79.5; do
        bench "loss-qwen3-experts-budget${budget/./}" "${qwen3[@]}" 'lora.moe_targets=[attention,routed_experts]' \
            "training.memory_budget_gib=$budget"
    done
    bench loss-qwen3-attn "${qwen3[@]}"
    bench loss-glm-air-20l --shape glm-4.5-air --layers 20 "${qwen3[@]:2}"
    ;;
weighted-silu)
    # The weighted SiLU's backward as one Triton kernel: the MoE kernels alone, then on one H200 the
    # routed-expert run held under HF + PEFT's peak (79.6 GiB), Qwen3 LoRA on attention and GLM-4.5-Air (20
    # layers), each against HF in the same run.
    if [[ -z ${BENCH_ONLY:-} || " $BENCH_ONLY " == *" moe-kernels "* ]]; then
        python3 "$(dirname "$0")/moe_kernels.py" --no-triton --out "$results/moe_kernels.txt"
    fi
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    qwen3=(--shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 3 --warmup 3 --baseline hf "${extra[@]}")
    bench silu-qwen3-experts-budget795 "${qwen3[@]}" 'lora.moe_targets=[attention,routed_experts]' \
        training.memory_budget_gib=79.5
    bench silu-qwen3-attn "${qwen3[@]}"
    bench silu-glm-air-20l --shape glm-4.5-air --layers 20 "${qwen3[@]:2}"
    ;;
gathered)
    # The down projection's input gradient gathering its rows inside quack's GEMM (gathered_grouped_mm): the MoE
    # kernels alone (their last table: the gathered GEMMs), then on one H200 Qwen3-30B-A3B LoRA on attention at
    # skewed and random routing, the routed-expert run held under HF + PEFT's peak (79.6 GiB) and GLM-4.5-Air (20
    # layers) and Mixtral-8x7B, each against HF in the same run. Needs shardtune[quack] for the gathered GEMMs.
    if [[ -z ${BENCH_ONLY:-} || " $BENCH_ONLY " == *" moe-kernels "* ]]; then
        python3 "$(dirname "$0")/moe_kernels.py" --no-triton --out "$results/moe_kernels.txt"
    fi
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    qwen3=(--shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 3 --warmup 3 --baseline hf "${extra[@]}")
    bench gathered-qwen3-attn "${qwen3[@]}"
    bench gathered-qwen3-attn-random "${qwen3[@]}" --routing random
    bench gathered-qwen3-experts-budget795 "${qwen3[@]}" 'lora.moe_targets=[attention,routed_experts]' \
        training.memory_budget_gib=79.5
    bench gathered-glm-air-20l --shape glm-4.5-air --layers 20 "${qwen3[@]:2}"
    bench gathered-mixtral --shape mixtral-8x7b "${qwen3[@]:2}"
    ;;
quack-tiles)
    # quack's GEMM with the tile configurations pinned in shardtune/model/grouped_gemm.py, and auto taking quack at
    # every expert width: every SM90 configuration on each GEMM of the fused block (moe_kernels.py
    # --quack-configs), then on one H200 Qwen3-30B-A3B LoRA on attention, GLM-4.5-Air (20 layers) and Mixtral-8x7B,
    # each against HF in the same run. Needs shardtune[quack].
    if [[ -z ${BENCH_ONLY:-} || " $BENCH_ONLY " == *" moe-kernels "* ]]; then
        python3 "$(dirname "$0")/moe_kernels.py" --quack-configs --out "$results/moe_kernels_quack_configs.txt"
    fi
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    qwen3=(--shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 3 --warmup 3 --baseline hf "${extra[@]}")
    bench tiles-qwen3-attn "${qwen3[@]}"
    bench tiles-glm-air-20l --shape glm-4.5-air --layers 20 "${qwen3[@]:2}"
    bench tiles-mixtral --shape mixtral-8x7b "${qwen3[@]:2}"
    ;;
routing-kernels)
    # The router's top-k and the (token, choice) pairs' expert order as Triton kernels
    # (shardtune/model/routing_kernels.py): the routing bookkeeping alone (moe_kernels.py --routing), then on one
    # H200 Qwen3-30B-A3B LoRA on attention and GLM-4.5-Air (20 layers), each against HF in the same run.
    if [[ -z ${BENCH_ONLY:-} || " $BENCH_ONLY " == *" moe-kernels "* ]]; then
        python3 "$(dirname "$0")/moe_kernels.py" --routing --out "$results/moe_kernels_routing.txt"
    fi
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    qwen3=(--shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 3 --warmup 3 --baseline hf "${extra[@]}")
    bench routing-qwen3-attn "${qwen3[@]}"
    bench routing-glm-air-20l --shape glm-4.5-air --layers 20 "${qwen3[@]:2}"
    ;;
moe-loss)
    # The chunked loss (training.loss_chunk_tokens: auto, the default) on one GPU: the loss alone against all
    # logits at once (benchmarks/loss_kernels.py), then Qwen3-30B-A3B LoRA in the default config against HF +
    # PEFT (on an 80 GB GPU it fits at batch 2 only with the chunked loss).
    if [[ -z ${BENCH_ONLY:-} || " $BENCH_ONLY " == *" loss-kernels "* ]]; then
        python3 "$(dirname "$0")/loss_kernels.py" --out "$results/loss_kernels.txt"
    fi
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    moe=(--shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 3 --warmup 3 "${extra[@]}")
    bench loss-qwen3-attn "${moe[@]}" --baseline hf
    bench loss0-qwen3-attn "${moe[@]}" training.loss_chunk_tokens=0
    bench loss-qwen3-experts "${moe[@]}" 'lora.moe_targets=[attention,routed_experts]' --baseline hf
    ;;
h200-grouped-gemm)
    # model.grouped_gemm: the kernels alone (benchmarks/moe_kernels.py), then the default config's step with
    # quack's varlen GEMM (auto) against the same step with torch._grouped_mm, in the same call, no baseline.
    if [[ -z ${BENCH_ONLY:-} || " $BENCH_ONLY " == *" moe-kernels "* ]]; then
        python3 "$(dirname "$0")/moe_kernels.py" --no-triton --out "$results/moe_kernels_quack.txt"
    fi
    ab=(--seq 4096 --batch 2 --steps 6 --warmup 3)
    for kernel in torch auto; do
        bench "gemm-$kernel-qwen3-attn" --shape qwen3-30b-a3b "${ab[@]}" "model.grouped_gemm=$kernel"
    done
    for kernel in torch auto; do
        bench "gemm-$kernel-qwen3-experts" --shape qwen3-30b-a3b "${ab[@]}" "model.grouped_gemm=$kernel" \
            'lora.moe_targets=[attention,routed_experts]'
    done
    # Every layer checkpointed (the routed-expert run at HF's memory, and the issue's first command).
    for kernel in torch quack; do
        bench "gemm-$kernel-qwen3-experts-every" --shape qwen3-30b-a3b "${ab[@]}" --gradient-checkpointing \
            'lora.moe_targets=[attention,routed_experts]' "model.grouped_gemm=$kernel"
        bench "gemm-$kernel-qwen3-attn-every" --shape qwen3-30b-a3b "${ab[@]}" --gradient-checkpointing \
            "model.grouped_gemm=$kernel"
    done
    # Wider experts, where auto keeps torch: quack asked for by name.
    for kernel in torch quack; do
        bench "gemm-$kernel-glm-air-10l" --shape glm-4.5-air --layers 10 "${ab[@]}" "model.grouped_gemm=$kernel"
    done
    for kernel in torch quack; do
        bench "gemm-$kernel-mixtral" --shape mixtral-8x7b "${ab[@]}" "model.grouped_gemm=$kernel"
    done
    ;;
h200-moe-profile)
    # Where shardtune's Qwen3-30B-A3B LoRA-on-attention step goes: two profiled steps after warm-up, and the
    # share of device time in GEMM kernels (issue 20's target: at least 70%).
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    bench moe-qwen3-attn-profile --shape qwen3-30b-a3b --seq 4096 --batch 2 --gradient-checkpointing --steps 2 \
        --warmup 4 'logging.profile_steps=[3,4]' "${extra[@]}" &&
        python3 -m shardtune.bench.profile_share "$work/moe-qwen3-attn-profile/shardtune/profile/rank0.trace.json.gz" |
        tee "$results/moe-qwen3-attn-profile.gemm.txt"
    ;;
host-overhead)
    # Issue 20: whether the Qwen3-30B-A3B LoRA-on-attention step waits on the host, on an 80 GB GPU: 32 layers
    # without checkpointing (the regime of the full model on one H200). A profile of two warm-up steps read by
    # device_gaps.py, then inductor settings that cut host or elementwise time, each against the default in
    # the same call: the C++ wrapper (launches from C++), combo kernels (independent kernels launched as
    # one), coordinate-descent tuning of the Triton kernels' block sizes. BENCH_ONLY: run names.
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    layers=(--shape qwen3-30b-a3b --layers 32 --seq 4096 --batch 2 --steps 8 --warmup 3
        training.gradient_checkpointing=false "${extra[@]}")
    bench host-profile "${layers[@]}" 'logging.profile_steps=[2,3]' &&
        python3 "$(dirname "$0")/device_gaps.py" "$work/host-profile/shardtune/profile/rank0.trace.json.gz" \
            >"$results/host-profile.gaps.txt"
    mkdir -p "$work/combo"
    printf 'import torch._inductor.config\ntorch._inductor.config.combo_kernels = True\n' \
        >"$work/combo/sitecustomize.py"
    bench host-default "${layers[@]}"
    TORCHINDUCTOR_CPP_WRAPPER=1 bench host-cpp-wrapper "${layers[@]}"
    PYTHONPATH="$work/combo${PYTHONPATH:+:$PYTHONPATH}" bench host-combo-kernels "${layers[@]}"
    TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 bench host-coordinate-descent "${layers[@]}"
    bench host-default-again "${layers[@]}"
    # The C++ wrapper where every layer is checkpointed (each forward runs twice), against the default.
    bench host-checkpointed "${layers[@]}" training.gradient_checkpointing=true
    TORCHINDUCTOR_CPP_WRAPPER=1 bench host-cpp-wrapper-checkpointed "${layers[@]}" training.gradient_checkpointing=true
    ;;
float8)
    # model.float8_experts and model.float8_linear (shardtune/model/float8.py): the GEMMs in bf16 against float8
    # with rowwise scales (moe_kernels.py --float8); on an 80 GB GPU, each against bf16 in the same call (BENCH_ONLY
    # splits them over calls): Qwen3-30B-A3B LoRA on attention (32 layers, no checkpointing) in bf16, float8
    # experts, and float8 experts and linear layers, twice; GLM-4.5-Air (10 layers, no checkpointing) and
    # Llama-3-8B LoRA in bf16 and in float8; then on one H200 Qwen3-30B-A3B (LoRA on attention; on attention and
    # the routed experts under HF's peak) and GLM-4.5-Air (20 layers) in float8, each against HF in the same run.
    if [[ -z ${BENCH_ONLY:-} || " $BENCH_ONLY " == *" moe-kernels "* ]]; then
        python3 "$(dirname "$0")/moe_kernels.py" --float8 --out "$results/moe_kernels_float8.txt"
    fi
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    all=(model.float8_experts=true model.float8_linear=true)
    common=(--seq 4096 --batch 2 --steps 8 --warmup 3 "${extra[@]}")
    layers=(--shape qwen3-30b-a3b --layers 32 "${common[@]}" training.gradient_checkpointing=false)
    for round in 1 2; do
        bench "f8-ab-bf16-$round" "${layers[@]}"
        bench "f8-ab-experts-$round" "${layers[@]}" model.float8_experts=true
        bench "f8-ab-all-$round" "${layers[@]}" "${all[@]}"
        # BENCH_CODE: a directory holding another shardtune package (the "before" of a change), timed in turn
        # with this checkout's, both options on (f8-code-*: Qwen3-30B-A3B 32 layers, GLM-4.5-Air 10 layers).
        if [[ -n ${BENCH_CODE:-} ]]; then
            (cd "$BENCH_CODE" && bench "f8-code-before-$round" "${layers[@]}" "${all[@]}")
            bench "f8-code-after-$round" "${layers[@]}" "${all[@]}"
            (cd "$BENCH_CODE" && bench "f8-code-before-glm-$round" --shape glm-4.5-air --layers 10 "${common[@]}" \
                training.gradient_checkpointing=false "${all[@]}")
            bench "f8-code-after-glm-$round" --shape glm-4.5-air --layers 10 "${common[@]}" \
                training.gradient_checkpointing=false "${all[@]}"
        fi
    done
    glm=(--shape glm-4.5-air --layers 10 "${common[@]}" training.gradient_checkpointing=false)
    bench f8-glm-10l-bf16 "${glm[@]}"
    bench f8-glm-10l-all "${glm[@]}" "${all[@]}"
    bench f8-llama8b-bf16 --shape llama3-8b "${common[@]}"
    bench f8-llama8b-linear --shape llama3-8b "${common[@]}" model.float8_linear=true
    qwen3=(--shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 3 --warmup 3 --baseline hf "${extra[@]}")
    bench f8-qwen3-attn "${qwen3[@]}" "${all[@]}"
    bench f8-qwen3-experts "${qwen3[@]}" "${all[@]}" 'lora.moe_targets=[attention,routed_experts]' \
        training.memory_budget_gib=79.5
    bench f8-glm-air-20l --shape glm-4.5-air --layers 20 "${qwen3[@]:2}" "${all[@]}"
    ;;
float8-gemm)
    # The float8 experts' grouped GEMM: shardtune's Triton kernel (shardtune/model/float8_grouped_kernel.py, the
    # default on Hopper) against torch._scaled_grouped_mm (model.grouped_gemm=torch), both float8 options on, no
    # checkpointing, alternating in one call on an 80 GB GPU: Qwen3-30B-A3B LoRA on attention (32 layers) and
    # GLM-4.5-Air (10 layers), twice each; f8g-qwen3-48l-{torch,triton} on one H200 (BENCH_ONLY). The kernels
    # alone: `BENCH_ONLY=moe-kernels` (moe_kernels.py --float8);
    # against HF on one H200: `BENCH_ONLY="f8-qwen3-attn f8-glm-air-20l" benchmarks/suite.sh float8 DIR`.
    if [[ -z ${BENCH_ONLY:-} || " $BENCH_ONLY " == *" moe-kernels "* ]]; then
        python3 "$(dirname "$0")/moe_kernels.py" --float8 --shapes qwen3-30b-a3b glm-4.5-air mixtral-8x7b \
            --out "$results/moe_kernels_float8_triton.txt"
    fi
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    all=(model.float8_experts=true model.float8_linear=true)
    common=(--seq 4096 --batch 2 --steps 8 --warmup 3 training.gradient_checkpointing=false "${all[@]}" "${extra[@]}")
    for round in 1 2; do
        bench "f8g-qwen3-torch-$round" --shape qwen3-30b-a3b --layers 32 "${common[@]}" model.grouped_gemm=torch
        bench "f8g-qwen3-triton-$round" --shape qwen3-30b-a3b --layers 32 "${common[@]}"
        bench "f8g-glm-torch-$round" --shape glm-4.5-air --layers 10 "${common[@]}" model.grouped_gemm=torch
        bench "f8g-glm-triton-$round" --shape glm-4.5-air --layers 10 "${common[@]}"
    done
    # All 48 layers of Qwen3-30B-A3B (85 GiB: one H200), only where BENCH_ONLY names them.
    if [[ -n ${BENCH_ONLY:-} ]]; then
        bench f8g-qwen3-48l-torch --shape qwen3-30b-a3b "${common[@]}" model.grouped_gemm=torch
        bench f8g-qwen3-48l-triton --shape qwen3-30b-a3b "${common[@]}"
    fi
    ;;
device-wait)
    # Qwen3-30B-A3B, LoRA on attention, both float8 options, all 48 layers on one H200 (the float8 target's run): two
    # steps profiled with the device's kernels alone (logging.profile_host=false: the host keeps its unprofiled pace),
    # the idle time summed by the kernel the device waited for (device_gaps.py); BENCH_CODE: another checkout's
    # package profiled the same way. Then 12 measured steps with nvidia-smi sampling the SM clock, power and
    # clock-event reasons every 100 ms, each step's share (gpu_clocks.py).
    qwen3=(--shape qwen3-30b-a3b --seq 4096 --batch 2 model.float8_experts=true model.float8_linear=true)
    profiled=(--steps 6 --warmup 3 'logging.profile_steps=[6,7]' logging.profile_host=false)
    here=$(dirname "$(realpath "$0")")
    for code in . ${BENCH_CODE:-}; do
        name=wait-qwen3-48l
        [[ $code == . ]] || name=wait-code-qwen3-48l
        trace=$work/$name/shardtune/profile/rank0.trace.json.gz
        if (cd "$code" && bench "$name" "${qwen3[@]}" "${profiled[@]}") && [[ -f $trace ]]; then
            python3 "$here/device_gaps.py" "$trace" >"$results/$name.gaps.txt"
            sed -n '1,8p;/^idle by the kernel after/,/^$/p' "$results/$name.gaps.txt"
        fi
    done
    if [[ -z ${BENCH_ONLY:-} || " $BENCH_ONLY " == *" clocks-qwen3-48l "* ]]; then
        nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active --format=csv,noheader \
            -lms 100 >"$work/clocks.csv" &
        sampler=$!
        bench clocks-qwen3-48l "${qwen3[@]}" --steps 12 --warmup 3
        kill "$sampler"
        python3 "$here/gpu_clocks.py" "$work/clocks-qwen3-48l/shardtune" "$work/clocks.csv" | tee "$results/clocks-qwen3-48l.txt"
    fi
    ;;
shared-gemms)
    # LoRA's down-projections that read one input as one GEMM (shardtune/distributed/shared_input_gemms.py): one
    # compiled layer with and without the rewrite (bf16, then float8 frozen linears), then, where BENCH_CODE names a
    # checkout without it, whole steps alternating with it: Qwen3-30B-A3B LoRA attention, both float8 options, all 48
    # layers (one H200), and Llama-3-8B LoRA on every linear layer in the default config. Against HF on one H200:
    # `BENCH_OVERRIDES="--steps 12" BENCH_ONLY=f8-qwen3-attn benchmarks/suite.sh float8 DIR`.
    if [[ -z ${BENCH_ONLY:-} || " $BENCH_ONLY " == *" layer "* ]]; then
        python3 "$(dirname "$0")/shared_input_gemms.py" --out "$results/shared_input_gemms_bf16.txt"
        python3 "$(dirname "$0")/shared_input_gemms.py" --float8-linear --out "$results/shared_input_gemms_float8.txt"
    fi
    qwen3=(--shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 12 --warmup 3 model.float8_experts=true
        model.float8_linear=true)
    llama=(--shape llama3-8b --seq 4096 --batch 2 --steps 10 --warmup 3)
    if [[ -n ${BENCH_CODE:-} ]]; then
        for round in 1 2; do
            (cd "$BENCH_CODE" && bench "shared-qwen3-48l-before-$round" "${qwen3[@]}")
            bench "shared-qwen3-48l-after-$round" "${qwen3[@]}"
        done
        for round in 1 2; do
            (cd "$BENCH_CODE" && bench "shared-llama3-8b-before-$round" "${llama[@]}")
            bench "shared-llama3-8b-after-$round" "${llama[@]}"
        done
    fi
    ;;
cuda-graphs)
    # parallel.cuda_graphs (shardtune/distributed/layer_graphs.py, on by default on one GPU): the layers replayed as
    # CUDA graphs (graphs-on-*) against the same compiled layers launched from Python (graphs-off-*), alternating;
    # then against HF in the same run, the default config (graphs on): graphs-qwen3-attn, graphs-glm-air-20l.
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    qwen3=(--shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 10 --warmup 3 training.gradient_checkpointing=false
        model.float8_experts=true model.float8_linear=true "${extra[@]}")
    for round in 1 2; do
        bench "graphs-on-$round" "${qwen3[@]}" parallel.cuda_graphs=true
        bench "graphs-off-$round" "${qwen3[@]}" parallel.cuda_graphs=false
    done
    all=(model.float8_experts=true model.float8_linear=true)
    bench graphs-qwen3-attn --shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 12 --warmup 3 --baseline hf "${all[@]}" \
        "${extra[@]}"
    bench graphs-glm-air-20l --shape glm-4.5-air --layers 20 --seq 4096 --batch 2 --steps 6 --warmup 3 --baseline hf \
        "${all[@]}" "${extra[@]}"
    bench graphs-qwen3-attn-bf16 --shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 12 --warmup 3 --baseline hf \
        "${extra[@]}"
    bench graphs-qwen3-experts --shape qwen3-30b-a3b --seq 4096 --batch 2 --steps 6 --warmup 3 --baseline hf \
        "${all[@]}" 'lora.moe_targets=[attention,routed_experts]' training.memory_budget_gib=79.5 "${extra[@]}"
    bench graphs-mixtral --shape mixtral-8x7b --seq 4096 --batch 2 --steps 4 --warmup 3 --baseline hf "${extra[@]}"
    ;;
ddp-graphs)
    # parallel.cuda_graphs under DDP (2 GPUs): the layers replayed as CUDA graphs (ddp-graphs-on-*) against the same
    # compiled layers launched from Python (ddp-graphs-off-*), alternating. Qwen3-30B-A3B LoRA on attention, 24
    # layers, both float8 options: nothing recomputed on an 80 GB GPU, so every layer is graphed.
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    qwen3=(--shape qwen3-30b-a3b --layers 24 --seq 4096 --batch 2 --steps 10 --warmup 3 --strategy ddp
        model.float8_experts=true model.float8_linear=true "${extra[@]}")
    for round in 1 2; do
        bench "ddp-graphs-on-$round" "${qwen3[@]}" parallel.cuda_graphs=true
        bench "ddp-graphs-off-$round" "${qwen3[@]}" parallel.cuda_graphs=false
    done
    ;;
gemm-share)
    # Where the device time of the MoE steps most bound by their GEMMs goes (GEMMs, attention, the rest:
    # shardtune.bench.profile_share), two profiled steps after warm-up. CUDA graphs off: the same kernels, each
    # launched, and so traced, on its own.
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    # Llama 4 Scout's first 12 layers in bf16 only: its transposed experts have no float8 path.
    for precision in bf16 float8; do
        options=()
        shapes=(glm-air-20l mixtral)
        [[ $precision == float8 ]] && options=(model.float8_experts=true model.float8_linear=true)
        [[ $precision == bf16 ]] && shapes+=(llama4-scout-12l)
        for shape in "${shapes[@]}"; do
            case $shape in
            glm-air-20l) model=(--shape glm-4.5-air --layers 20) ;;
            mixtral) model=(--shape mixtral-8x7b) ;;
            llama4-scout-12l) model=(--shape llama4-scout-17b-16e --layers 12) ;;
            esac
            name=share-$shape-$precision
            bench "$name" "${model[@]}" --seq 4096 --batch 2 --steps 2 --warmup 4 'logging.profile_steps=[3,4]' \
                parallel.cuda_graphs=false "${options[@]}" "${extra[@]}" &&
                python3 -m shardtune.bench.profile_share "$work/$name/shardtune/profile/rank0.trace.json.gz" |
                tee "$results/$name.gemm.txt"
        done
    done
    ;;
more-moe)
    # The fused block on the architectures it serves beyond issue 20's targets, in the default config against HF +
    # PEFT in the same run (LoRA on attention), then with LoRA on the routed experts too: DeepSeek-V2-Lite (softmax
    # routing, MLA), ERNIE-4.5-21B-A3B (softmax scores chosen with a correction bias) and gpt-oss-20b (transposed,
    # biased experts with a clamped GLU).
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    for shape in deepseek-v2-lite ernie-4.5-21b-a3b gpt-oss-20b; do
        bench "more-$shape" --shape "$shape" --seq 4096 --batch 2 --steps 10 --warmup 3 --baseline hf "${extra[@]}"
        bench "more-$shape-experts" --shape "$shape" --seq 4096 --batch 2 --steps 6 --warmup 3 --baseline hf \
            'lora.moe_targets=[attention,routed_experts]' "${extra[@]}"
    done
    ;;
llama4)
    # Llama 4 Scout's text model, its first 12 of 48 layers (28B of 108B parameters, so that HF + PEFT fits one
    # H200 too), against HF + PEFT in the same run: LoRA on attention, then on the routed experts too. transformers'
    # Llama 4 block runs every token through all 16 experts (the unchosen ones on rows scaled to 0); the fused
    # block runs each token's one.
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    bench llama4-scout --shape llama4-scout-17b-16e --layers 12 --seq 4096 --batch 2 --steps 8 --warmup 3 \
        --baseline hf "${extra[@]}"
    bench llama4-scout-experts --shape llama4-scout-17b-16e --layers 12 --seq 4096 --batch 2 --steps 6 --warmup 3 \
        --baseline hf 'lora.moe_targets=[attention,routed_experts]' "${extra[@]}"
    ;;
gemma4)
    # Gemma 4 26B-A4B's text model, all 30 layers (25.2B parameters), against HF + PEFT in the same run: LoRA on
    # attention, then on the routed experts too. Its decoder layers keep their forward, the routed experts beside the
    # dense MLP: the fused path routes (FusedRouter) and runs the experts' grouped GEMMs in the layer.
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    bench gemma4-26b-a4b --shape gemma4-26b-a4b --seq 4096 --batch 2 --steps 8 --warmup 3 --baseline hf "${extra[@]}"
    bench gemma4-26b-a4b-experts --shape gemma4-26b-a4b --seq 4096 --batch 2 --steps 6 --warmup 3 --baseline hf \
        'lora.moe_targets=[attention,routed_experts]' "${extra[@]}"
    # Where the LoRA-attention step goes: two profiled steps, kernels by kind (shardtune.bench.profile_share).
    bench gemma4-26b-a4b-profile --shape gemma4-26b-a4b --seq 4096 --batch 2 --steps 2 --warmup 4 \
        'logging.profile_steps=[3,4]' parallel.cuda_graphs=false "${extra[@]}" &&
        python3 -m shardtune.bench.profile_share "$work/gemma4-26b-a4b-profile/shardtune/profile/rank0.trace.json.gz" |
        tee "$results/gemma4-26b-a4b-profile.gemm.txt"
    ;;
gptoss-glu)
    # GPT-OSS's clamped GLU keeping only its gate/up output for backward: gpt-oss-20b, LoRA on attention + routed
    # experts, then LoRA on attention (the "before" of RESULTS.md: the first run on the code before the change).
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    bench gptoss-glu-experts --shape gpt-oss-20b --seq 4096 --batch 2 --steps 6 --warmup 3 \
        'lora.moe_targets=[attention,routed_experts]' "${extra[@]}"
    bench gptoss-glu-attn --shape gpt-oss-20b --seq 4096 --batch 2 --steps 8 --warmup 3 "${extra[@]}"
    ;;
gptoss-padded)
    # gpt-oss-20b without packing (LoRA on attention): no sdpa (its sinks), so training takes FlexAttention with
    # transformers' mask of the padded rows (gptoss-padded), or, asked for, eager attention, whose heads x S x S scores
    # the planner counts and gradient_checkpointing: auto recomputes (gptoss-eager).
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    bench gptoss-padded --shape gpt-oss-20b --seq 4096 --batch 2 --steps 4 --warmup 2 data.packing=false "${extra[@]}"
    bench gptoss-eager --shape gpt-oss-20b --seq 4096 --batch 2 --steps 4 --warmup 2 data.packing=false \
        model.attn_implementation=eager "${extra[@]}"
    ;;
gemma-dense)
    # Dense Gemma: Gemma 2's capped attention scores have no sdpa, so training on a GPU takes FlexAttention, with
    # transformers' mask of padded rows (gemma2-9b-padded) or shardtune's of packed rows (gemma2-9b-packed); Gemma 3
    # (no capped scores) takes sdpa with padded rows (gemma3-12b-padded). The peaks are the planner's rows.
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    bench gemma2-9b-padded --shape gemma2-9b --seq 4096 --batch 2 --steps 4 --warmup 2 data.packing=false "${extra[@]}"
    bench gemma2-9b-packed --shape gemma2-9b --seq 4096 --batch 2 --steps 4 --warmup 3 "${extra[@]}"
    bench gemma3-12b-padded --shape gemma3-12b --seq 4096 --batch 2 --steps 4 --warmup 2 data.packing=false \
        "${extra[@]}"
    ;;
last-moe)
    # The last MoE architectures put on the fused block, against HF + PEFT in the same run, LoRA on attention, then on
    # the routed experts too: LFM2-8B-A1B (all 24 layers; short convolutions in 18), Phi-3.5-MoE (its first 16 of 32
    # layers: sparsemixer routing, sampled in training), JetMoE-8B (all 24 layers; its attention experts stay on
    # transformers' code) and DBRX (its first 8 of 40 layers, 26B parameters; 2-D expert slabs).
    read -ra extra <<<"${BENCH_OVERRIDES:-}"
    for run in lfm2-8b-a1b:24 phi3.5-moe:16 jetmoe-8b:24 dbrx:8; do
        shape=${run%%:*} layers=${run##*:}
        bench "last-$shape" --shape "$shape" --layers "$layers" --seq 4096 --batch 2 --steps 8 --warmup 3 --baseline hf \
            "${extra[@]}"
        # JetMoE's and DBRX's frozen weights in float8 (both options), LoRA on attention.
        if [[ $shape == jetmoe-8b || $shape == dbrx ]]; then
            bench "last-$shape-float8" --shape "$shape" --layers "$layers" --seq 4096 --batch 2 --steps 8 --warmup 3 \
                --baseline hf model.float8_experts=true model.float8_linear=true "${extra[@]}"
        fi
        # DBRX's routed experts take no LoRA (PEFT's parameter adapters break their forward): lora.moe_targets refuses.
        [[ $shape == dbrx ]] && continue
        bench "last-$shape-experts" --shape "$shape" --layers "$layers" --seq 4096 --batch 2 --steps 6 --warmup 3 \
            --baseline hf 'lora.moe_targets=[attention,routed_experts]' "${extra[@]}"
    done
    ;;
*)
    echo "unknown suite $suite (see the list at the top of $0)" >&2
    exit 2
    ;;
esac
