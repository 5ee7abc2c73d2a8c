// megamoe-run: starts one process per GPU rank and fails loudly when any rank fails or hangs.
//
//   megamoe-run -n 2 [--timeout SECONDS] [--isolate-gpus | --one-gpu] -- program args...
//
// Each rank gets the torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT) plus MEGAMOE_RENDEZVOUS_DIR, a fresh folder the ranks use to exchange
// bootstrap ids (src/comm/rendezvous.hpp). NVLink multicast stays off in every rank
// (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1): on shared
// machines a program using it can take the host's GPUs out of service.
// --one-gpu puts every rank on the first visible GPU (several ranks sharing one device, each its
// own process and CUDA context, time-sliced: how the multi-rank code is tested on one GPU).
// Output lines are prefixed with "[rank r]". The first rank to exit non-zero (or by a signal)
// stops the others and sets the exit code; a run past --timeout is reported as a hang (exit 124).
// SIGINT, SIGTERM or SIGHUP to the launcher stops every rank first, then the launcher by that signal.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "cli_args.hpp"

namespace {

constexpr int kHangExitCode = 124;
constexpr int kUsageExitCode = 2;

struct Options {
  int ranks = 0;
  double timeout_s = 0;  // 0: none
  bool isolate_gpus = false;
  bool one_gpu = false;
  std::vector<std::string> command;
};

void print_usage(std::FILE* to) {
  std::fprintf(to,
               "usage: megamoe-run -n RANKS [--timeout SECONDS] [--isolate-gpus | --one-gpu] -- program [args...]\n"
               "  -n RANKS        processes to start, one per GPU (LOCAL_RANK selects the GPU)\n"
               "  --timeout S     stop every rank and exit 124 when the run lasts longer than S seconds\n"
               "  --isolate-gpus  also set CUDA_VISIBLE_DEVICES=LOCAL_RANK in each rank\n"
               "  --one-gpu       every rank sees only the first visible GPU (ranks sharing one device)\n");
}

[[noreturn]] void usage(const std::string& message) {
  std::fprintf(stderr, "megamoe-run: %s\n", message.c_str());
  print_usage(stderr);
  std::exit(kUsageExitCode);
}

Options parse(int argc, char** argv) {
  Options o;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg == "--help" || arg == "-h") {
      print_usage(stdout);
      std::exit(0);
    }
    if ((arg == "-n" || arg == "--timeout") && i + 1 >= argc) usage(arg + " needs a value");
    if (arg == "-n") {
      try {
        o.ranks = static_cast<int>(
            megamoe::bench::cli::parse_integer("-n", argv[++i], 1, 1024, "a rank count between 1 and 1024"));
      } catch (const megamoe::bench::cli::UsageError& e) {
        usage(e.what());
      }
    } else if (arg == "--timeout") {
      const std::string text = argv[++i];
      char* end = nullptr;
      o.timeout_s = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || !(o.timeout_s >= 0)) {
        usage("--timeout needs a number of seconds >= 0, got '" + text + "'");
      }
    } else if (arg == "--isolate-gpus") {
      o.isolate_gpus = true;
    } else if (arg == "--one-gpu") {
      o.one_gpu = true;
    } else {
      usage("unknown argument '" + arg + "'");
    }
  }
  for (; i < argc; ++i) o.command.emplace_back(argv[i]);
  if (o.ranks == 0) usage("-n RANKS is required");
  if (o.isolate_gpus && o.one_gpu) usage("--isolate-gpus and --one-gpu exclude each other");
  if (o.command.empty()) usage("no program given after --");
  return o;
}

// The signal that asked the launcher to stop (Ctrl-C, a CI job's timeout, a closed terminal); 0 while
// none has. The ranks run in process groups of their own, out of the terminal's reach: unless the
// launcher stops them, they outlive it, holding their GPUs.
volatile std::sig_atomic_t stop_signal = 0;

void on_stop_signal(int signal) { stop_signal = signal; }

void catch_stop_signals() {
  for (const int signal : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction action {};
    sigaction(signal, nullptr, &action);
    if (action.sa_handler == SIG_IGN) continue;  // nohup's SIGHUP, a background job's SIGINT: left ignored
    action = {};
    action.sa_handler = on_stop_signal;  // no SA_RESTART: the poll below returns at once
    sigemptyset(&action.sa_mask);
    sigaction(signal, &action, nullptr);
  }
}

struct Rank {
  int index = 0;
  pid_t pid = -1;
  int output = -1;  // read end of the pipe holding the rank's stdout and stderr
  std::string pending;  // a partial line
  bool running = true;
  int status = 0;
};

void flush_partial_line(Rank& rank) {
  if (rank.pending.empty()) return;
  std::printf("[rank %d] %s\n", rank.index, rank.pending.c_str());
  rank.pending.clear();
}

// Reads what the rank wrote and prints every complete line as "[rank r] line"; returns false at
// end of file (after printing a last partial line).
bool forward_output(Rank& rank) {
  char buffer[4096];
  const ssize_t n = read(rank.output, buffer, sizeof buffer);
  if (n > 0) rank.pending.append(buffer, static_cast<size_t>(n));
  size_t newline;
  while ((newline = rank.pending.find('\n')) != std::string::npos) {
    std::printf("[rank %d] %s\n", rank.index, rank.pending.substr(0, newline).c_str());
    rank.pending.erase(0, newline + 1);
  }
  if (n <= 0) flush_partial_line(rank);
  std::fflush(stdout);
  return n > 0;
}

// The first entry of the launcher's CUDA_VISIBLE_DEVICES, or "0" without one.
std::string first_visible_gpu() {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible == nullptr || *visible == '\0') return "0";
  const std::string list = visible;
  return list.substr(0, list.find(','));
}

int free_port() {
  // Deterministic per launcher process and unlikely to collide; ranks only need agreement.
  return 20000 + static_cast<int>(getpid() % 20000);
}

pid_t spawn(const Options& o, int rank, int write_fd, const std::string& rendezvous, int port) {
  const pid_t pid = fork();
  if (pid != 0) return pid;
  setpgid(0, 0);  // its own process group, so stopping a rank stops whatever it started too
  dup2(write_fd, STDOUT_FILENO);
  dup2(write_fd, STDERR_FILENO);
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(o.ranks).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(o.ranks).c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  setenv("MEGAMOE_RENDEZVOUS_DIR", rendezvous.c_str(), 1);
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
  if (o.isolate_gpus) setenv("CUDA_VISIBLE_DEVICES", std::to_string(rank).c_str(), 1);
  if (o.one_gpu) setenv("CUDA_VISIBLE_DEVICES", first_visible_gpu().c_str(), 1);
  std::vector<char*> argv;
  for (const std::string& arg : o.command) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  execvp(argv[0], argv.data());
  std::fprintf(stderr, "cannot start '%s': %s\n", argv[0], std::strerror(errno));
  _exit(127);
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + strsignal(WTERMSIG(status));
  return "stopped";
}

// Stops every rank's process group (leftover children of finished ranks too).
void stop_all(std::vector<Rank>& ranks) {
  for (Rank& r : ranks) kill(-r.pid, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (Rank& r : ranks) {
    while (r.running && std::chrono::steady_clock::now() < deadline) {
      if (waitpid(r.pid, &r.status, WNOHANG) == r.pid) r.running = false;
      else std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (r.running) {
      kill(-r.pid, SIGKILL);
      waitpid(r.pid, &r.status, 0);
      r.running = false;
    }
  }
  for (Rank& r : ranks) kill(-r.pid, SIGKILL);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  char rendezvous_template[] = "/tmp/megamoe-rendezvous-XXXXXX";
  const char* rendezvous = mkdtemp(rendezvous_template);
  if (!rendezvous) {
    std::perror("megamoe-run: mkdtemp");
    return 1;
  }
  const int port = free_port();
  catch_stop_signals();
  std::vector<Rank> ranks(o.ranks);
  for (int r = 0; r < o.ranks; ++r) {
    int fds[2];
    if (pipe(fds) != 0) {
      std::perror("megamoe-run: pipe");
      return 1;
    }
    ranks[r].index = r;
    ranks[r].pid = spawn(o, r, fds[1], rendezvous, port);
    close(fds[1]);
    ranks[r].output = fds[0];
  }

  const auto start = std::chrono::steady_clock::now();
  int exit_code = 0;
  std::string failure;
  int open_outputs = o.ranks;
  while (true) {
    std::vector<pollfd> polls;
    for (const Rank& r : ranks)
      if (r.output >= 0) polls.push_back({r.output, POLLIN, 0});
    if (!polls.empty() && poll(polls.data(), polls.size(), 100) > 0) {
      for (const pollfd& p : polls) {
        if (!(p.revents & (POLLIN | POLLHUP))) continue;
        for (Rank& r : ranks) {
          if (r.output != p.fd) continue;
          if (!forward_output(r)) {
            close(r.output);
            r.output = -1;
            --open_outputs;
          }
        }
      }
    } else if (polls.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    bool any_running = false;
    for (Rank& r : ranks) {
      if (r.running && waitpid(r.pid, &r.status, WNOHANG) == r.pid) {
        r.running = false;
        if (failure.empty() && !(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0)) {
          failure = "rank " + std::to_string(r.index) + " " + describe(r.status);
          exit_code = WIFEXITED(r.status) ? WEXITSTATUS(r.status) : 128 + WTERMSIG(r.status);
        }
      }
      any_running |= r.running;
    }
    if (!failure.empty() && any_running) {
      std::fprintf(stderr, "megamoe-run: %s; stopping the other ranks\n", failure.c_str());
      stop_all(ranks);
      any_running = false;
    }
    if (any_running && stop_signal != 0) {
      failure = std::string("stopped by signal ") + strsignal(stop_signal);
      std::fprintf(stderr, "megamoe-run: %s; stopping every rank\n", failure.c_str());
      stop_all(ranks);
      any_running = false;
    }
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (any_running && o.timeout_s > 0 && elapsed > o.timeout_s) {
      std::string hung;
      for (const Rank& r : ranks)
        if (r.running) hung += (hung.empty() ? "" : ", ") + std::to_string(r.index);
      char timeout[32];  // as given: --timeout 0.5 is not "0 s"
      std::snprintf(timeout, sizeof timeout, "%g", o.timeout_s);
      failure = "rank(s) " + hung + " still running after " + timeout + " s: treated as a hang";
      exit_code = kHangExitCode;
      std::fprintf(stderr, "megamoe-run: %s; stopping every rank\n", failure.c_str());
      stop_all(ranks);
      any_running = false;
    }
    if (!any_running && open_outputs == 0) break;
    if (!any_running) {
      // Every rank has exited: print what is left in the pipes, then stop reading (a
      // grandchild that outlived its rank must not keep the launcher alive).
      for (Rank& r : ranks) {
        if (r.output < 0) continue;
        pollfd p{r.output, POLLIN, 0};
        while (poll(&p, 1, 0) > 0 && forward_output(r)) {
        }
        flush_partial_line(r);
        close(r.output);
        r.output = -1;
        --open_outputs;
      }
    }
  }
  std::filesystem::remove_all(rendezvous);
  if (!failure.empty()) std::fprintf(stderr, "megamoe-run: FAILED: %s\n", failure.c_str());
  if (stop_signal != 0) {
    // End by the same signal, now that the ranks are gone, so that a calling shell sees it (a loop
    // of runs stops on Ctrl-C).
    std::fflush(stdout);
    std::signal(stop_signal, SIG_DFL);
    std::raise(stop_signal);
    return 128 + stop_signal;
  }
  if (!failure.empty()) return exit_code == 0 ? 1 : exit_code;
  return 0;
}
