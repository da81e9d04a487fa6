// Runs the real dtrain-launch binary on real processes (launcher/testdata/child.sh).
#include "launcher/launcher.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "tests/flags.h"
#include "tests/subprocess.h"

namespace {

std::string g_launcher;
std::string g_child;

using dtrain::launcher::parse_args;

std::string make_dir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string tmpl = std::string(base ? base : "/tmp") + "/launchXXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  EXPECT_NE(::mkdtemp(buf.data()), nullptr);
  return buf.data();
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Running or sleeping; a zombie (killed, not yet reaped by its new parent) counts as dead.
bool alive(pid_t pid) {
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  auto paren = stat.rfind(')');
  if (paren == std::string::npos || paren + 2 >= stat.size()) return false;
  char state = stat[paren + 2];
  return state != 'Z' && state != 'X';
}

pid_t read_pid(const std::string& path) { return std::atoi(read_file(path).c_str()); }

// Waits (up to 10 s) until both ranks of a "sleep" or "ignore-term" child have started theirs.
void wait_for_children(const std::string& dir) {
  for (int i = 0; i < 200 && !(std::ifstream(dir + "/child.0") && std::ifstream(dir + "/child.1"));
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// Starts the launcher with `args`; stdout goes to `out_path` when given, and stderr too when
// `both`.
pid_t start_launcher(const std::vector<std::string>& args, const std::string& out_path = "",
                     bool both = false) {
  pid_t pid = ::fork();
  if (pid == 0) {
    if (!out_path.empty()) {
      FILE* f = std::fopen(out_path.c_str(), "w");
      ::dup2(fileno(f), 1);
      if (both) ::dup2(fileno(f), 2);
    }
    std::vector<char*> argv{const_cast<char*>(g_launcher.c_str())};
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(126);
  }
  return pid;
}

int wait_exit(pid_t pid) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(LaunchArgs, ParsesTorchrunStyleOptionsAndTheProgram) {
  auto o = parse_args({"--nproc_per_node=4", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                       "10.0.0.1", "--master-port", "1234", "--max-restarts", "3", "--backend",
                       "gloo", "--", "prog", "--lr", "0.1"});
  EXPECT_EQ(o.nproc_per_node, 4);
  EXPECT_EQ(o.nnodes, 2);
  EXPECT_EQ(o.node_rank, 1);
  EXPECT_EQ(o.master_addr, "10.0.0.1");
  EXPECT_EQ(o.master_port, 1234);
  EXPECT_EQ(o.max_restarts, 3);
  EXPECT_EQ(o.backend, "gloo");
  EXPECT_EQ(o.command, (std::vector<std::string>{"prog", "--lr", "0.1"}));
  auto d = parse_args({"prog", "--flag"});
  EXPECT_EQ(d.nproc_per_node, 1);
  EXPECT_EQ(d.master_port, 29500);
  EXPECT_EQ(d.command, (std::vector<std::string>{"prog", "--flag"}));
}

// torchrun's elastic form: MIN:MAX nodes; node ranks name nodes up to MAX - 1.
TEST(LaunchArgs, NnodesMinColonMaxMakesAnElasticJob) {
  auto e = parse_args({"--nnodes", "2:4", "--node-rank", "3", "--elastic-wait", "2.5", "prog"});
  EXPECT_EQ(e.min_nodes, 2);
  EXPECT_EQ(e.nnodes, 4);
  EXPECT_TRUE(e.elastic());
  EXPECT_EQ(e.nnodes_text(), "2:4");
  EXPECT_EQ(e.elastic_wait_s, 2.5);
  auto fixed = parse_args({"--nnodes", "3:3", "prog"});
  EXPECT_FALSE(fixed.elastic()) << "MIN = MAX is a fixed-size job";
  EXPECT_EQ(fixed.nnodes_text(), "3");
  auto plain = parse_args({"--nnodes", "3", "prog"});
  EXPECT_FALSE(plain.elastic());
  EXPECT_EQ(plain.nnodes_text(), "3");
}

TEST(LaunchArgs, RefusesBadArgumentsWithAUsageLine) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--nproc-per-node", "two", "prog"},
           {"--bogus", "prog"},
           {"--nproc-per-node", "2"},
           {"--nproc-per-node", "0", "prog"},
           {"--nnodes", "2", "--node-rank", "2", "prog"},
           {"--nnodes", "3:2", "prog"},
           {"--nnodes", "0:2", "prog"},
           {"--nnodes", "2:", "prog"},
           {"--nnodes", "1:x", "prog"},
           {"--nnodes", "-1", "prog"},
           {"--nnodes", "2:3", "--node-rank", "3", "prog"},
           {"--elastic-wait", "-1", "prog"},
           {"--backend", "tcp", "prog"},
           {"--master-port", "70000", "prog"},
           {"--nnodes", "2", "--master-port", "0", "prog"},
           // fuzz/fuzz_launcher_args checks these are refused:
           // more ranks than an int, an endless grace.
           {"--nproc-per-node", "65536", "--nnodes", "1048576", "prog"},
           {"--grace-period", "inf", "prog"},
           {"--grace-period", "1e300", "prog"}}) {
    try {
      parse_args(args);
      ADD_FAILURE() << "accepted " << args[0] << " " << args[1];
    } catch (const dtrain::UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("usage: dtrain-launch"), std::string::npos) << e.what();
    }
  }
}

TEST(Launcher, PrefixesEveryLineAndSetsTorchrunVariables) {
  std::string dir = make_dir();
  pid_t pid = start_launcher(
      {"--nproc-per-node", "2", "--master-port", "0", "--backend", "gloo", g_child, "env", dir},
      dir + "/out");
  ASSERT_EQ(wait_exit(pid), 0);
  std::string out = read_file(dir + "/out");
  for (int r = 0; r < 2; ++r) {
    std::string rank = std::to_string(r);
    std::string want = "[rank " + rank + "] RANK=" + rank + " WORLD_SIZE=2 LOCAL_RANK=" + rank +
                       " LOCAL_WORLD_SIZE=2 GROUP_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=";
    EXPECT_NE(out.find(want), std::string::npos) << out;
    EXPECT_NE(out.find("[rank " + rank + "] partial\n"), std::string::npos) << out;
  }
  EXPECT_NE(out.find("RESTART=0 BACKEND=gloo OMP=1"), std::string::npos) << out;
  EXPECT_EQ(out.find("MASTER_PORT=0 "), std::string::npos) << "port 0 must become a real port";
}

TEST(Launcher, FailingRankSetsExitCodeAndNoRankSurvivesTheGracePeriod) {
  std::string dir = make_dir();
  auto t0 = std::chrono::steady_clock::now();
  pid_t pid = start_launcher(
      {"--nproc-per-node", "3", "--master-port", "0", "--grace-period", "1", g_child, "fail", dir});
  EXPECT_EQ(wait_exit(pid), 3);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 1.0 + 5.0);
  for (int r : {0, 2}) {
    pid_t rank_pid = read_pid(dir + "/pid." + std::to_string(r));
    pid_t sleeper = read_pid(dir + "/child." + std::to_string(r));
    ASSERT_GT(rank_pid, 0);
    ASSERT_GT(sleeper, 0);
    EXPECT_FALSE(alive(rank_pid)) << "rank " << r << " survived";
    EXPECT_FALSE(alive(sleeper)) << "a child of rank " << r << " survived";
  }
}

TEST(Launcher, SigtermToTheLauncherEndsEveryRank) {
  std::string dir = make_dir();
  pid_t pid = start_launcher({"--nproc-per-node", "2", "--master-port", "0", "--grace-period", "5",
                              g_child, "sleep", dir});
  wait_for_children(dir);
  ::kill(pid, SIGTERM);
  EXPECT_EQ(wait_exit(pid), 128 + SIGTERM);
  for (int r : {0, 1}) {
    pid_t rank_pid = read_pid(dir + "/pid." + std::to_string(r));
    pid_t sleeper = read_pid(dir + "/child." + std::to_string(r));
    ASSERT_GT(rank_pid, 0) << "rank " << r << " never started";
    ASSERT_GT(sleeper, 0) << "rank " << r << " never started its child";
    EXPECT_FALSE(alive(rank_pid));
    EXPECT_FALSE(alive(sleeper));
  }
}

// The launcher SIGKILLed: the ranks die with it (PDEATHSIG), and the guardian ends their
// children, including one that ignores SIGTERM (SIGKILL after the grace period).
TEST(Launcher, SigkillOfTheLauncherLeavesNothingRunning) {
  std::string dir = make_dir();
  pid_t pid = start_launcher({"--nproc-per-node", "2", "--master-port", "0", "--grace-period", "1",
                              g_child, "ignore-term", dir});
  wait_for_children(dir);
  std::vector<pid_t> job;
  for (int r : {0, 1}) {
    for (const char* what : {"/pid.", "/child."}) {
      pid_t p = read_pid(dir + what + std::to_string(r));
      ASSERT_GT(p, 0) << dir << what << r << " was never written";
      ASSERT_TRUE(alive(p));
      job.push_back(p);
    }
  }
  auto t0 = std::chrono::steady_clock::now();
  ::kill(pid, SIGKILL);
  EXPECT_EQ(wait_exit(pid), 128 + SIGKILL);
  auto any_alive = [&] {
    for (pid_t p : job) {
      if (alive(p)) return true;
    }
    return false;
  };
  while (any_alive() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (pid_t p : job) EXPECT_FALSE(alive(p)) << "pid " << p << " outlived the launcher";
}

TEST(Launcher, RestartsTheGroupExactlyMaxRestartsTimes) {
  std::string dir = make_dir();
  pid_t pid = start_launcher({"--nproc-per-node", "2", "--master-port", "0", "--max-restarts", "2",
                              g_child, "count", dir});
  EXPECT_EQ(wait_exit(pid), 1);
  EXPECT_EQ(read_file(dir + "/count.0"), "0\n1\n2\n");
  EXPECT_EQ(read_file(dir + "/count.1"), "0\n1\n2\n");
}

// Node 0's rendezvous address and port are checked before any rank starts.
TEST(Launcher, APortInUseOrAForeignMasterAddressIsAUsageError) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(sa);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  const std::string busy = std::to_string(ntohs(sa.sin_port));
  auto r = dtrain::testing::run_command(g_launcher + " --master-port " + busy + " " + g_child +
                                        " env /tmp");
  ::close(fd);
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--master-port " + busy + " on 127.0.0.1 is already in use"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("RANK="), std::string::npos) << "a rank started:\n" << r.output;
  // TEST-NET-1 (RFC 5737): never an address of this machine.
  r = dtrain::testing::run_command(g_launcher + " --master-addr 192.0.2.1 " + g_child +
                                   " env /tmp");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("--master-addr 192.0.2.1 cannot serve the rendezvous on this machine"),
            std::string::npos)
      << r.output;
  r = dtrain::testing::run_command(g_launcher + " --master-addr no-such-host.invalid " + g_child +
                                   " env /tmp");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("does not resolve"), std::string::npos) << r.output;
}

// Node 0's store port is reserved by the launcher for the whole job, across restarts: no other
// process takes it (--master-port 0 included), while rank 0's store binds it and listens.
TEST(Launcher, TheStorePortStaysReservedAcrossAttempts) {
  const std::string dir = make_dir();
  const std::string script = "a=$TORCHELASTIC_RESTART_COUNT; echo $MASTER_PORT > " + dir +
                             "/port.$a; i=0; " + "while [ ! -e " + dir +
                             "/go.$a ] && [ $i -lt 400 ]; do sleep 0.05; i=$((i+1)); done; exit 1";
  pid_t pid = start_launcher(
      {"--nproc-per-node", "1", "--master-port", "0", "--max-restarts", "1", "sh", "-c", script});
  auto bind_port = [](int port, bool reuse, bool listen) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    if (reuse) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0 &&
                    (!listen || ::listen(fd, 1) == 0);
    ::close(fd);
    return ok;
  };
  std::string first;
  for (const std::string attempt : {"0", "1"}) {
    SCOPED_TRACE(attempt);
    const std::string file = dir + "/port." + attempt;
    for (int i = 0; i < 200 && read_file(file).empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    const std::string text = read_file(file);
    ASSERT_FALSE(text.empty());
    if (first.empty()) first = text;
    EXPECT_EQ(text, first);  // the same port in every attempt
    const int port = std::atoi(text.c_str());
    EXPECT_FALSE(bind_port(port, false, false)) << "another process took port " << port;
    EXPECT_TRUE(bind_port(port, true, true)) << "a store could not listen on port " << port;
    std::ofstream(dir + "/go." + attempt) << "go";
  }
  EXPECT_EQ(wait_exit(pid), 1);
}

// A port that is free on 127.0.0.1 with the next one free too: a two-node job's store port
// and its launchers' (--agent-port, by default the next).
int free_port_pair() {
  auto can_bind = [](int port, int* got) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    sa.sin_port = htons(static_cast<uint16_t>(port));
    socklen_t len = sizeof(sa);
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
    if (got != nullptr) *got = ntohs(sa.sin_port);
    ::close(fd);
    return ok;
  };
  for (int i = 0; i < 50; ++i) {
    int port = 0;
    if (can_bind(0, &port) && port < 65535 && can_bind(port + 1, nullptr)) return port;
  }
  return 0;
}

// Two launchers of one job (--nnodes 2 on 127.0.0.1), one rank each; their output (stdout
// and stderr) goes to out.0 and out.1 in `dir`.
std::vector<pid_t> start_two_nodes(const std::string& dir, int port,
                                   const std::vector<std::vector<std::string>>& node_args,
                                   const std::vector<std::string>& command) {
  std::vector<pid_t> pids;
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> args{
        "--nnodes",           "2",        "--node-rank", std::to_string(node), "--master-port",
        std::to_string(port), "--run-id", "two",         "--grace-period",     "2"};
    args.insert(args.end(), node_args[node].begin(), node_args[node].end());
    args.push_back("--");
    args.insert(args.end(), command.begin(), command.end());
    pids.push_back(start_launcher(args, dir + "/out." + std::to_string(node), true));
  }
  return pids;
}

// A rank failing on node 1 stops node 0's rank too, and both nodes restart at attempt 1.
TEST(Launcher, TheNodesOfAJobRestartTogether) {
  const std::string dir = make_dir();
  const int port = free_port_pair();
  ASSERT_NE(port, 0);
  const std::string script = "a=$TORCHELASTIC_RESTART_COUNT; echo $a >> " + dir +
                             "/count.$RANK; "
                             "if [ $a = 0 ] && [ $RANK = 1 ]; then sleep 0.5; exit 5; fi; "
                             "if [ $a = 0 ]; then exec sleep 30; fi; exit 0";
  const auto t0 = std::chrono::steady_clock::now();
  auto pids = start_two_nodes(dir, port, {{"--max-restarts", "1"}, {"--max-restarts", "1"}},
                              {"sh", "-c", script});
  EXPECT_EQ(wait_exit(pids[0]), 0) << read_file(dir + "/out.0");
  EXPECT_EQ(wait_exit(pids[1]), 0) << read_file(dir + "/out.1");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
  EXPECT_EQ(read_file(dir + "/count.0"), "0\n1\n");
  EXPECT_EQ(read_file(dir + "/count.1"), "0\n1\n");
  const std::string out0 = read_file(dir + "/out.0");
  EXPECT_NE(out0.find("rank 1 on node 1 exited with code 5; stopping this node's ranks"),
            std::string::npos)
      << out0;
  EXPECT_NE(out0.find("restarting every node's ranks (restart 1 of 1"), std::string::npos) << out0;
  EXPECT_NE(read_file(dir + "/out.1").find("restarting every node's ranks (restart 1 of 1"),
            std::string::npos);
}

// Restarts are counted job-wide: with none left, both nodes give up with the failed rank's code.
TEST(Launcher, WithoutRestartsLeftEveryNodeExitsWithTheFailedRanksCode) {
  const std::string dir = make_dir();
  const int port = free_port_pair();
  ASSERT_NE(port, 0);
  auto pids = start_two_nodes(dir, port, {{}, {}},
                              {"sh", "-c", "if [ $RANK = 0 ]; then exit 7; fi; exec sleep 30"});
  EXPECT_EQ(wait_exit(pids[0]), 7) << read_file(dir + "/out.0");
  EXPECT_EQ(wait_exit(pids[1]), 7) << read_file(dir + "/out.1");
  EXPECT_NE(read_file(dir + "/out.1")
                .find("the job ends on every node: rank 0 on node 0 exited "
                      "with code 7"),
            std::string::npos)
      << read_file(dir + "/out.1");
}

// Node 1's launcher is SIGKILLed: node 0 names it, ends its own rank, and exits; node 1's rank
// dies with its launcher.
TEST(Launcher, ALostNodeEndsTheJobNamingIt) {
  const std::string dir = make_dir();
  const int port = free_port_pair();
  ASSERT_NE(port, 0);
  auto pids = start_two_nodes(dir, port, {{"--max-restarts", "3"}, {"--max-restarts", "3"}},
                              {g_child, "sleep", dir});
  wait_for_children(dir);
  const pid_t rank0 = read_pid(dir + "/child.0"), rank1 = read_pid(dir + "/child.1");
  ASSERT_GT(rank0, 0);
  ASSERT_GT(rank1, 0);
  const auto t0 = std::chrono::steady_clock::now();
  ::kill(pids[1], SIGKILL);
  wait_exit(pids[1]);
  EXPECT_EQ(wait_exit(pids[0]), 1) << read_file(dir + "/out.0");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  const std::string out0 = read_file(dir + "/out.0");
  EXPECT_NE(out0.find("node 1 is lost: its dtrain-launch closed the connection"), std::string::npos)
      << out0;
  EXPECT_EQ(out0.find("restarting"), std::string::npos) << "a lost node is not restarted\n" << out0;
  for (int i = 0; i < 100 && (alive(rank0) || alive(rank1)); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_FALSE(alive(rank0));
  EXPECT_FALSE(alive(rank1));
}

// Node 0's launcher is SIGKILLed: node 1 names it, ends its rank and exits.
TEST(Launcher, LosingNodeZeroEndsTheOtherNodes) {
  const std::string dir = make_dir();
  const int port = free_port_pair();
  ASSERT_NE(port, 0);
  auto pids = start_two_nodes(dir, port, {{}, {}}, {g_child, "sleep", dir});
  wait_for_children(dir);
  const pid_t rank1 = read_pid(dir + "/child.1");
  ASSERT_GT(rank1, 0);
  ::kill(pids[0], SIGKILL);
  wait_exit(pids[0]);
  EXPECT_EQ(wait_exit(pids[1]), 1) << read_file(dir + "/out.1");
  EXPECT_NE(read_file(dir + "/out.1")
                .find("node 0 is lost: its dtrain-launch at 127.0.0.1:" + std::to_string(port + 1) +
                      " closed the connection"),
            std::string::npos)
      << read_file(dir + "/out.1");
  for (int i = 0; i < 100 && alive(rank1); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_FALSE(alive(rank1));
}

// A node whose options differ from node 0's is refused, naming both; node 0 ends too.
TEST(Launcher, ANodeWithOtherOptionsIsRefusedNamingThem) {
  const std::string dir = make_dir();
  const int port = free_port_pair();
  ASSERT_NE(port, 0);
  auto pids = start_two_nodes(dir, port, {{"--max-restarts", "1"}, {"--max-restarts", "2"}},
                              {g_child, "sleep", dir});
  EXPECT_EQ(wait_exit(pids[1]), 2) << read_file(dir + "/out.1");
  EXPECT_EQ(wait_exit(pids[0]), 1) << read_file(dir + "/out.0");
  EXPECT_NE(read_file(dir + "/out.1")
                .find("refused this node: node 1 has --max-restarts 2, "
                      "node 0 1; give every node the same"),
            std::string::npos)
      << read_file(dir + "/out.1");
  EXPECT_NE(read_file(dir + "/out.0").find("node 1 is lost: it was refused"), std::string::npos)
      << read_file(dir + "/out.0");
}

TEST(Launcher, MissingProgramExits127) {
  pid_t pid = start_launcher({"--master-port", "0", "/nonexistent/program"});
  EXPECT_EQ(wait_exit(pid), 127);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  g_launcher = dtrain::testing::flag_value(argc, argv, "launcher");
  g_child = dtrain::testing::flag_value(argc, argv, "child");
  if (g_launcher.empty() || g_child.empty()) {
    std::cerr << "usage: launcher_test --launcher=PATH --child=PATH" << std::endl;
    return 2;
  }
  return RUN_ALL_TESTS();
}
