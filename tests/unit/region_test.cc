// Region: the tensor store's buffers. Opened through /proc by this same process (the kernel
// treats that like any process of the user; tests/python/test_tensor_store.py covers peers).

#include "transport/shm/region.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>

#include "loom/error.h"

namespace loom::shm {
namespace {

TEST(Region, PeersSeeTheOwnersBytesReadOnly) {
  auto owner = Region::create(1 << 16);
  ASSERT_TRUE(owner->writable());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(owner->data()) % 4096, 0u);  // page-aligned data
  owner->beginWrite();
  std::memset(owner->data(), 7, owner->capacity());
  const uint64_t generation = owner->endWrite();
  EXPECT_EQ(generation, 2u);

  auto reader = Region::open(::getpid(), owner->fd(), owner->id(), owner->capacity());
  EXPECT_FALSE(reader->writable());
  EXPECT_EQ(reader->fd(), -1);  // the mapping is kept, not the descriptor
  EXPECT_EQ(reader->generation(), generation);
  EXPECT_EQ(reader->data()[12345], 7);
  EXPECT_TRUE(reader->unchangedSince(generation));
}

TEST(Region, AWriteBegunSinceACopyInvalidatesIt) {
  auto owner = Region::create(4096);
  const uint64_t first = (owner->beginWrite(), owner->endWrite());
  auto reader = Region::open(::getpid(), owner->fd(), owner->id(), owner->capacity());
  owner->beginWrite();  // odd: a reader must not keep what it copies now
  EXPECT_FALSE(reader->unchangedSince(first));
  EXPECT_FALSE(reader->unchangedSince(first + 1));  // odd generations are never whole
  owner->setProgress(1000);
  EXPECT_EQ(reader->progress(), 1000u);
  const uint64_t second = owner->endWrite();
  EXPECT_EQ(second, first + 2);
  EXPECT_TRUE(reader->unchangedSince(second));
}

TEST(Region, AnAbandonedWriteSkipsTheGenerationItWouldHaveEndedAt) {
  auto owner = Region::create(4096);
  const uint64_t before = (owner->beginWrite(), owner->endWrite());
  owner->beginWrite();
  const uint64_t promised = before + 2;  // what readers of the version were told
  const uint64_t after = owner->abandonWrite();
  EXPECT_GT(after, promised);
  EXPECT_EQ(after % 2, 0u);
  EXPECT_NE(owner->generation(), promised);
  owner->beginWrite();
  EXPECT_EQ(owner->endWrite(), after + 2);
}

TEST(Region, OpeningTheWrongRegionIsRefusedWithAReason) {
  auto owner = Region::create(4096);
  Region::Id other = owner->id();
  other[0] ^= 1;
  try {
    Region::open(::getpid(), owner->fd(), other, owner->capacity());
    FAIL() << "a region with another id was opened";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMismatch);
    EXPECT_NE(std::string(e.what()).find("no longer region"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Region::open(::getpid(), owner->fd(), owner->id(), 8192), Error);  // wrong size
  try {
    Region::open(::getpid(), 100000, owner->id(), owner->capacity());  // no such descriptor
    FAIL() << "a closed descriptor was opened";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerFailure);
    EXPECT_NE(std::string(e.what()).find("has exited or released the region"), std::string::npos);
  }
}

TEST(Region, IdsRoundTripThroughHex) {
  auto owner = Region::create(0);  // a header alone, as for device memory
  EXPECT_EQ(owner->capacity(), 0u);
  EXPECT_EQ(regionIdFromHex(regionIdHex(owner->id())), owner->id());
  EXPECT_THROW(regionIdFromHex("zz"), Error);
  EXPECT_THROW(regionIdFromHex(std::string(32, 'g')), Error);
}

}  // namespace
}  // namespace loom::shm
