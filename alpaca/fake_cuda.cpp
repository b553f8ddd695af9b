// Fake CUDA devices for a CPU build of torch (alpaca/fake_cuda.py loads it with LD_PRELOAD): CUDA's hooks say
// CUDA is built, and a device guard answers for 8 devices whose streams and events do nothing. Only fake tensors
// (FakeTensorMode) may live on them: no memory is ever allocated there.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace at {
struct FakeCUDAHooks : CUDAHooksInterface {
  FakeCUDAHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
};
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", FakeCUDAHooks);
}  // namespace at

namespace {
using namespace c10;
constexpr DeviceIndex kDevices = 8;
thread_local DeviceIndex current_device = 0;
thread_local StreamId current_streams[kDevices] = {0};
StreamId next_stream = 1;

struct FakeCUDAGuard final : public impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device d) const override {
    Device old = getDevice();
    current_device = d.index();
    return old;
  }
  Device getDevice() const override { return Device(DeviceType::CUDA, current_device); }
  void setDevice(Device d) const override { current_device = d.index(); }
  void uncheckedSetDevice(Device d) const noexcept override { current_device = d.index(); }
  Stream getStream(Device d) const override { return Stream(Stream::UNSAFE, d, current_streams[d.index()]); }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::UNSAFE, d, 0); }
  Stream getNewStream(Device d, int) const override { return Stream(Stream::UNSAFE, d, next_stream++); }
  Stream getStreamFromGlobalPool(Device d, bool) const override { return Stream(Stream::UNSAFE, d, next_stream++); }
  Stream exchangeStream(Stream s) const override {
    StreamId old = current_streams[s.device_index()];
    current_streams[s.device_index()] = s.id();
    return Stream(Stream::UNSAFE, s.device(), old);
  }
  DeviceIndex deviceCount() const noexcept override { return kDevices; }
  void record(void**, const Stream&, const DeviceIndex, const EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const DataPtr&, const Stream&) const override {}
  double elapsedTime(void*, void*, const DeviceIndex) const override { return 0.0; }
};
C10_REGISTER_GUARD_IMPL(CUDA, FakeCUDAGuard);
}  // namespace
