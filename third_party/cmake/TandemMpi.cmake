# Decides whether the multi-process layer is built (TANDEM_MPI=AUTO|ON|OFF) and
# finds MPI's C API (Debian: openmpi-bin + libopenmpi-dev). Sets TANDEM_WITH_MPI.
# AUTO builds it when MPI is found; ON fails loudly when it is not.
set(TANDEM_WITH_MPI OFF)
string(TOUPPER "${TANDEM_MPI}" _tandem_mpi)
if(NOT _tandem_mpi MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "TANDEM_MPI must be AUTO, ON or OFF, not '${TANDEM_MPI}'")
endif()
if(NOT _tandem_mpi STREQUAL "OFF")
  enable_language(C)  # FindMPI's C component probes with the C compiler
  find_package(MPI QUIET COMPONENTS C)
  if(MPI_C_FOUND)
    set(TANDEM_WITH_MPI ON)
    message(STATUS "tandem: MPI ON (MPI ${MPI_C_VERSION}, mpiexec ${MPIEXEC_EXECUTABLE})")
  elseif(_tandem_mpi STREQUAL "ON")
    message(FATAL_ERROR "TANDEM_MPI=ON but MPI's C API was not found (Debian: apt-get install "
                        "openmpi-bin libopenmpi-dev, or set MPI_HOME)")
  else()
    message(STATUS "tandem: MPI OFF (MPI's C API not found: apt-get install openmpi-bin libopenmpi-dev)")
  endif()
else()
  message(STATUS "tandem: MPI OFF (TANDEM_MPI=OFF)")
endif()
