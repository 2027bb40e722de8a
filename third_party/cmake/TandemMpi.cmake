# Decides whether the multi-process layer is built (TANDEM_MPI=AUTO|ON|OFF) and
# finds MPI (Debian: openmpi-bin + libopenmpi-dev). Sets TANDEM_WITH_MPI.
# AUTO builds it when MPI is found; ON fails loudly when it is not.
#
# tandem calls MPI's C API from C++ (spawn/mpi_world.cc), so it asks FindMPI for
# the CXX component with the MPI-2 C++ bindings switched off: MPI::MPI_CXX then
# carries libmpi (the C library) and needs no C compiler. The installed
# tandemConfig.cmake finds the same component, so a CXX-only project can link
# the static tandem::spawn.
set(TANDEM_WITH_MPI OFF)
string(TOUPPER "${TANDEM_MPI}" _tandem_mpi)
if(NOT _tandem_mpi MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "TANDEM_MPI must be AUTO, ON or OFF, not '${TANDEM_MPI}'")
endif()
if(NOT _tandem_mpi STREQUAL "OFF")
  set(MPI_CXX_SKIP_MPICXX ON)
  find_package(MPI QUIET COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    set(TANDEM_WITH_MPI ON)
    message(STATUS "tandem: MPI ON (MPI ${MPI_CXX_VERSION}, mpiexec ${MPIEXEC_EXECUTABLE})")
  elseif(_tandem_mpi STREQUAL "ON")
    message(FATAL_ERROR "TANDEM_MPI=ON but MPI was not found (Debian: apt-get install "
                        "openmpi-bin libopenmpi-dev, or set MPI_HOME)")
  else()
    message(STATUS "tandem: MPI OFF (MPI not found: apt-get install openmpi-bin libopenmpi-dev)")
  endif()
else()
  message(STATUS "tandem: MPI OFF (TANDEM_MPI=OFF)")
endif()
