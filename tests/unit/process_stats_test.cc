// The leak checks' own instrument: sharedMemoryFootprint() must see what a process holds in
// shared memory and the names loom could write, and nothing of other programs' names.

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include <gtest/gtest.h>

#include "process_stats.h"

namespace loom {
namespace {

bool holds(const testing::SharedMemoryFootprint& f, const std::string& entry) {
  return std::find(f.held.begin(), f.held.end(), entry) != f.held.end();
}

TEST(ProcessStats, FootprintSeesSharedMemoryThisProcessHoldsAndLoomNames) {
  const testing::SharedMemoryFootprint before = testing::sharedMemoryFootprint();
  const std::string name = "/loom-footprint-test." + std::to_string(::getpid());
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  void* map = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(map, MAP_FAILED);

  const testing::SharedMemoryFootprint during = testing::sharedMemoryFootprint();
  EXPECT_NE(during, before);
  EXPECT_TRUE(holds(during, "fd /dev/shm" + name)) << testing::describe(during);
  EXPECT_TRUE(holds(during, "map /dev/shm" + name)) << testing::describe(during);
  EXPECT_NE(std::find(during.loomNames.begin(), during.loomNames.end(), name.substr(1)),
            during.loomNames.end())
      << testing::describe(during);

  ::munmap(map, 4096);
  ::close(fd);
  ::shm_unlink(name.c_str());
  // What this process holds is back as it was; of /dev/shm's names (the whole machine's, where
  // other tests run beside this one) only this test's own is checked.
  const testing::SharedMemoryFootprint after = testing::sharedMemoryFootprint();
  EXPECT_EQ(after.held, before.held) << testing::describe(after);
  EXPECT_EQ(std::find(after.loomNames.begin(), after.loomNames.end(), name.substr(1)),
            after.loomNames.end())
      << testing::describe(after);
}

TEST(ProcessStats, FootprintIgnoresOtherProgramsNames) {
  const testing::SharedMemoryFootprint before = testing::sharedMemoryFootprint();
  // What a DeepSpeed job beside CI leaves behind: not loom's, so not in the footprint.
  const std::string name = "/deepspeed_allreduce_buffer_test." + std::to_string(::getpid());
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ::close(fd);
  // Checked by its own name: /dev/shm is the whole machine's, and a test beside this one may
  // make or remove loom's names meanwhile (CI once failed here so).
  const testing::SharedMemoryFootprint after = testing::sharedMemoryFootprint();
  EXPECT_EQ(after.held, before.held) << testing::describe(after);
  EXPECT_EQ(std::find(after.loomNames.begin(), after.loomNames.end(), name.substr(1)),
            after.loomNames.end())
      << testing::describe(after);
  ::shm_unlink(name.c_str());
}

}  // namespace
}  // namespace loom
